"""Tool calling: parsers for the formats models write their calls in, and the grammar that
makes a model call a tool (``tool_choice`` "required" or a named function).

``parser_for_template(chat_template)`` picks the parser a chat template's own format implies;
``get_tool_parser(name)`` gives one by name (the server's ``--tool-call-parser``).
"""
from __future__ import annotations

from specdec.tool_parsers.base import ParsedOutput, ToolCall, ToolCallStream, ToolParser, new_call_id
from specdec.tool_parsers.grammar import tool_call_grammar
from specdec.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from specdec.tool_parsers.hermes import HermesToolParser
from specdec.tool_parsers.llama3_json import Llama3JsonToolParser
from specdec.tool_parsers.mistral import MistralToolParser
from specdec.tool_parsers.pythonic import PythonicToolParser
from specdec.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# vLLM's --tool-call-parser names
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
}

# what a chat template that renders tools in each format contains (checked in this order: the
# Qwen3-Coder template also holds <tool_call>, Llama 4's also Llama 3's markers)
_TEMPLATE_MARKERS = [
    ("qwen3_coder", ("<function=",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("tool▁calls▁begin",)),
    ("pythonic", ("<|python_start|>",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", "<|start_header_id|>ipython")),
]


def get_tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()


def parser_for_template(chat_template: str | dict | None) -> ToolParser | None:
    """The parser whose markers the chat template holds, or None (the template shows no format)."""
    if isinstance(chat_template, dict):  # named templates: any of them
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not chat_template:
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if any(m in chat_template for m in markers):
            return PARSERS[name]()
    return None


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser",
           "new_call_id", "parser_for_template", "tool_call_grammar"]
