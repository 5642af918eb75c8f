"""The offline API's tools: ``LLM.chat(..., tools=...)`` renders them through the chat
template, and with a grammar the output parses back into valid calls."""
from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.tool_parsers import get_tool_parser, tool_call_grammar

TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"enum": ["a", "b"]}}, "required": ["key"]}}}
MESSAGES = [{"role": "user", "content": "find it"}]


@pytest.fixture(scope="module")
def llm(llama_path) -> LLM:
    return LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=256)


def test_chat_passes_tools_to_the_template(llm):
    with_tools = llm.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tools=[TOOL])
    without = llm.apply_chat_template(MESSAGES, chat_template=TEMPLATE)
    assert llm.tokenizer.decode(with_tools).startswith("TOOLS: lookup")
    assert not llm.tokenizer.decode(without).startswith("TOOLS")


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_chat_with_a_tool_grammar_returns_a_parsable_call(llm, parser_name):
    parser = get_tool_parser(parser_name)
    grammar = tool_call_grammar(parser, [TOOL["function"]], parallel=False)
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=0, structured_outputs=grammar)
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TEMPLATE, tools=[TOOL])
    parsed = parser.parse(out[0].outputs[0].text)
    assert [c.name for c in parsed.tool_calls] == ["lookup"]
    assert json.loads(parsed.tool_calls[0].arguments) in ({"key": "a"}, {"key": "b"})
