"""The grammar of "call a tool now", with the name fixed to an allowed tool and the arguments
matching that tool's ``parameters`` schema, in one of two forms:

- ``tool_call_grammar``: the model's own call format (a parser with ``native_grammar``);
- ``json_calls_grammar``: the form any model can write (json_calls.py): a JSON array of
  ``{"name": ..., "parameters": {...}}`` for "required", the bare arguments object for a
  named tool.

Built with xgrammar's structural tags (a tag per tool: literal begin, JSON-schema content,
literal end; the tags joined by a separator) and handed to the engine as EBNF text, so it
travels as an ordinary ``StructuredOutputsParams(grammar=...)``. Each tool's schema is its
own root, so its ``$ref`` / ``$defs`` resolve as they would alone.
"""
from __future__ import annotations

import json

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
    from xgrammar.structural_tag import TagFormat, TagsWithSeparatorFormat

    tags = [TagFormat(begin=parser.call_begin(fn["name"]), content=_arguments_format(index, fn),
                      end=parser.call_end()) for index, fn in enumerate(functions)]
    if len(tags) == 1 and not parallel:
        fmt = tags[0]
    else:
        fmt = TagsWithSeparatorFormat(tags=tags, separator=parser.separator, at_least_one=True,
                                      stop_after_first=not parallel)
    return _as_params(fmt)


def json_calls_grammar(functions: list[dict], parallel: bool, named: bool) -> StructuredOutputsParams:
    """The JSON form: ``named`` -> the one function's arguments object; else an array of one
    call, or of one or more when ``parallel``, to any of ``functions``."""
    from xgrammar.structural_tag import ConstStringFormat, SequenceFormat, TagFormat, TagsWithSeparatorFormat

    from specdec.tool_parsers.json_calls import ARGUMENTS_KEY, CALL_SEPARATOR

    if named:
        return _as_params(_arguments_format(0, functions[0]))
    tags = [TagFormat(begin=f'{{"name": {json.dumps(fn["name"])}, "{ARGUMENTS_KEY}": ',
                      content=_arguments_format(index, fn), end="}") for index, fn in enumerate(functions)]
    calls = TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR, at_least_one=True,
                                    stop_after_first=not parallel)
    return _as_params(SequenceFormat(elements=[ConstStringFormat(value="["), calls, ConstStringFormat(value="]")]))


def _arguments_format(index: int, fn: dict):
    import xgrammar as xgr
    from xgrammar.structural_tag import JSONSchemaFormat

    schema = fn.get("parameters") or EMPTY_PARAMETERS
    try:
        xgr.Grammar.from_json_schema(schema)  # its own error, naming this tool
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types for a bad schema
        raise ToolSchemaError(index, f"{type(e).__name__}: {str(e)[:300]}") from None
    return JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)


def _as_params(fmt) -> StructuredOutputsParams:
    import xgrammar as xgr
    from xgrammar.structural_tag import StructuralTag

    ebnf = str(xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
    return StructuredOutputsParams(grammar=json_strings_fixed(ebnf))
