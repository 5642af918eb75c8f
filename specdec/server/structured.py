"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
mapped to one ``StructuredOutputsParams`` that the engine enforces.

At most one may be set. Every problem is a 400 naming the field as the client spelled it: two
constraints at once, a field ``StructuredOutputsParams`` refuses, and a schema, regex or
grammar that does not compile (the Preparer compiles it with ``EngineCore.compile_grammar``
before admission, so a stream gets a 400 status rather than an in-band error after its 200,
and the engine finds it in its compile cache).
"""
from __future__ import annotations

import dataclasses
import json
import re

from specdec.server.protocol import APIError
from specdec.structured_output import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_PARAMS_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def constraint_sizes(req) -> list[tuple[str, int]]:
    """(field, characters) of each constraint text the request carries, for --max-schema-chars."""
    sizes = []
    rf = req.response_format
    if rf is not None and rf.json_schema is not None and rf.json_schema.json_schema is not None:
        sizes.append(("response_format.json_schema.schema", _size(rf.json_schema.json_schema)))
    for key, value in (req.structured_outputs or {}).items():
        if key in ("json", "regex", "choice", "grammar"):
            sizes.append((f"structured_outputs.{key}", _size(value)))
    for field in _GUIDED:
        value = getattr(req, field)
        if value is not None:
            sizes.append((field, _size(value)))
    return sizes


def _size(value) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value))


def request_constraint(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None when unconstrained)."""
    found: list[tuple[str, dict]] = []  # (field, StructuredOutputsParams kwargs)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format_kwargs(rf)))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - _PARAMS_FIELDS)
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]} is not supported; the fields are "
                                f"{sorted(_PARAMS_FIELDS)}", param=f"structured_outputs.{unknown[0]}")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in _GUIDED.items():
        if getattr(req, field) is not None:
            found.append((field, {kind: getattr(req, field)}))
    if len(found) > 1:
        names = [f for f, _ in found]
        raise APIError(400, f"only one output constraint per request; got {' and '.join(names)}", param=names[1])
    if not found:
        return None, None
    field, kwargs = found[0]
    if req.guided_whitespace_pattern is not None:
        kwargs.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    return make_constraint(kwargs, field), field


def _response_format_kwargs(rf) -> dict:
    if rf.type == "json_object":
        return {"json_object": True}
    spec = rf.json_schema
    if spec is None:
        raise APIError(400, "response_format.json_schema is required when type is 'json_schema'",
                       param="response_format.json_schema")
    if spec.json_schema is None:  # OpenAI makes the schema optional: any JSON object then
        return {"json_object": True}
    return {"json": spec.json_schema}


def make_constraint(kwargs: dict, field: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**kwargs)``, its ValueError a 400 naming ``field`` (and its
    sub-field for ``structured_outputs``)."""
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{field}: {_strip_prefix(str(e))}", param=_param(field, str(e))) from None


def _strip_prefix(message: str) -> str:
    return re.sub(r"^StructuredOutputsParams\.?", "", message).strip()


def _param(field: str, message: str) -> str:
    m = re.match(r"StructuredOutputsParams\.(\w+)", message)
    if field == "structured_outputs" and m:
        return f"structured_outputs.{m.group(1)}"
    if field == "response_format":
        return "response_format.json_schema.schema" if m and m.group(1) == "json" else "response_format"
    return field


def engine_error_param(message: str, field: str | None) -> str | None:
    """The request field a grammar ``ValueError`` ("structured_outputs.<kind>: ...") is about,
    as the client spelled it (``field``: where the request's constraint came from)."""
    m = re.match(r"structured_outputs\.(\w+):", message)
    if field is None or m is None:
        return None
    if field == "structured_outputs":
        return f"structured_outputs.{m.group(1)}"
    if field == "response_format" and m.group(1) == "json":
        return "response_format.json_schema.schema"
    return field
