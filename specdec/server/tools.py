"""A chat request's tools: what the chat template gets, which parser reads the output, and,
for ``tool_choice`` "required" or a named function, the grammar that makes the model call.

- ``"auto"`` (the default when tools are given): the model decides; its output is parsed by
  the parser of the model's own format (``--tool-call-parser`` or the chat template's).
- ``"required"``: one or more calls (one if ``parallel_tool_calls`` is false) to any of the
  tools, enforced by a grammar; no text around them. The grammar is the model's own format
  where the parser can express it (``native_grammar``), else the JSON form any model can
  write (tool_parsers/json_calls.py), so it works whatever the chat template.
- ``{"type": "function", "function": {"name": ...}}``: exactly one call to that tool, enforced
  the same way (in the JSON form, the output is the arguments object).
- ``"none"``: no tool calls; the tools still reach the template (so the prompt, and its cached
  prefix, is the one "auto" would use, as vLLM does) and the output is returned as content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from specdec.structured_output import StructuredOutputsParams
from specdec.tool_parsers import ToolParser, tool_call_grammar
from specdec.tool_parsers.grammar import ToolSchemaError, json_calls_grammar
from specdec.tool_parsers.json_calls import JsonCallsToolParser, NamedToolCallParser


@dataclass
class ToolPlan:
    template_tools: list[dict] | None  # for apply_chat_template(tools=...)
    parser: ToolParser | None  # reads this request's output; None: it is all content
    constraint: StructuredOutputsParams | None  # the grammar for "required" / a named tool


NO_TOOLS = ToolPlan(None, None, None)


def tools_size(req: ChatCompletionRequest) -> int:
    """Characters of the tool definitions, for --max-schema-chars."""
    return len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools])) if req.tools else 0


def plan_tools(req: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return NO_TOOLS
    names = [t.function.name for t in req.tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(400, f"tools holds two functions named {duplicate!r}", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    if choice is None or choice == "auto":
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs the model's tool-call format, and this model's chat "
                                "template shows none this server can parse; start the server with "
                                "--tool-call-parser, or use tool_choice 'required' or a named tool",
                           param="tool_choice")
        return ToolPlan(template_tools, parser.for_tools(functions), None)
    parallel = req.parallel_tool_calls
    named = isinstance(choice, NamedToolChoice)
    if named:
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                                f"({names})", param="tool_choice")
        offset = names.index(choice.function.name)
        functions, parallel = [functions[offset]], False
    else:
        offset = 0
    try:
        if parser is not None and parser.native_grammar:
            constraint = tool_call_grammar(parser, functions, parallel)
        else:
            constraint = json_calls_grammar(functions, parallel, named)
            parser = NamedToolCallParser(functions[0]["name"]) if named else JsonCallsToolParser()
    except ToolSchemaError as e:
        param = f"tools.{offset + e.index}.function.parameters"
        raise APIError(400, f"{param}: xgrammar cannot build a grammar from this schema: {e}", param=param) from None
    except ValueError as e:  # e.g. the grammar over StructuredOutputsParams' size limit
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from None
    return ToolPlan(template_tools, parser, constraint)
