"""The grammar of "call a tool now": the model's own call format, nothing else, with the name
fixed to an allowed tool and the arguments matching that tool's ``parameters`` schema.

Built with xgrammar's structural tags (a tag per tool: literal begin, JSON-schema content,
literal end; the tags joined by the format's separator) and handed to the engine as EBNF
text, so it travels as an ordinary ``StructuredOutputsParams(grammar=...)``.
"""
from __future__ import annotations

from specdec.structured_output import StructuredOutputsParams
from specdec.structured_output.backend import json_strings_fixed
from specdec.tool_parsers.base import ToolParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters means none
MAX_WHITESPACE = 4  # per run inside the arguments: a newline and some indentation, no endless blanks


class ToolSchemaError(ValueError):
    """A tool's parameters schema xgrammar cannot turn into a grammar; ``index`` names the tool."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def tool_call_grammar(parser: ToolParser, functions: list[dict], parallel: bool) -> StructuredOutputsParams:
    """``functions``: OpenAI function definitions (``name``, optional ``parameters``), in the
    tool list's order, each allowed; one call, or one or more when ``parallel``."""
    import xgrammar as xgr
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    tags = []
    for index, fn in enumerate(functions):
        schema = fn.get("parameters") or EMPTY_PARAMETERS
        try:
            xgr.Grammar.from_json_schema(schema)  # its own error, naming this tool
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for a bad schema
            raise ToolSchemaError(index, f"{type(e).__name__}: {str(e)[:300]}") from None
        content = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)
        tags.append(TagFormat(begin=parser.call_begin(fn["name"]), content=content, end=parser.call_end()))
    if len(tags) == 1 and not parallel:
        fmt = tags[0]
    else:
        fmt = TagsWithSeparatorFormat(tags=tags, separator=parser.separator, at_least_one=True,
                                      stop_after_first=not parallel)
    ebnf = str(xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
    return StructuredOutputsParams(grammar=json_strings_fixed(ebnf))
