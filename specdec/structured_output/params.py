"""StructuredOutputsParams: vLLM's names for a request's output constraint.

Exactly one constraint is set: ``json`` (a JSON schema as a dict, a JSON string or a pydantic
model class), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF / GBNF text, root rule
``root``; Lark syntax is refused with a hint) or ``json_object=True`` (any JSON object). The schema is normalised to a JSON
string here, so the params are picklable and hashable for the compile cache.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

MAX_SPEC_CHARS = 1 << 20  # the longest schema / regex / grammar text accepted by the Python API


@dataclass
class StructuredOutputsParams:
    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            self.json = _schema_text(self.json)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r}")
        set_fields = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                      if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_fields or 'none'}")
        text = self.spec_text
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"StructuredOutputsParams.{self.kind} is {len(text)} characters, over the limit "
                             f"of {MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec_text(self) -> str:
        """The constraint as one string (a choice list as JSON)."""
        kind = self.kind
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple:
        return (self.kind, self.spec_text, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


def _schema_text(schema) -> str:
    """A JSON schema given as dict, JSON text or pydantic model class -> canonical JSON text."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("StructuredOutputsParams.json must be a JSON schema (dict, JSON string or pydantic "
                         f"model class), got {type(schema).__name__}")
    return _json.dumps(schema)
