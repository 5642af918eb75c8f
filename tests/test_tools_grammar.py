"""The grammar behind tool_choice "required" and a named tool: xgrammar's matcher accepts
exactly the model's call format with an allowed name and arguments that match the tool's
schema, and nothing else (no text around the calls, no second call unless parallel)."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from specdec.tool_parsers import get_tool_parser, tool_call_grammar
from specdec.tool_parsers.grammar import ToolSchemaError

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
NOOP = {"name": "noop"}  # no parameters: the arguments are {}

VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "\x07", "<eos>"]
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]))


def accepts(compiler, grammar_text: str, output: str) -> bool:
    """The whole output is a sentence of the grammar (it matches and may end there)."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar_text))
    return matcher.accept_string(output) and matcher.accept_token(EOS)


def hermes(name, args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def llama(name, args) -> str:
    return f'{{"name": "{name}", "parameters": {json.dumps(args)}}}'


GOOD = {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize("parser_name,call,sep", [("hermes", hermes, "\n"), ("llama3_json", llama, "; ")])
def test_required_accepts_calls_to_allowed_tools_only(compiler, parser_name, call, sep):
    parser = get_tool_parser(parser_name)
    parallel = tool_call_grammar(parser, [WEATHER, NOOP], parallel=True).grammar
    single = tool_call_grammar(parser, [WEATHER, NOOP], parallel=False).grammar
    one, two = call("get_weather", GOOD), call("get_weather", GOOD) + sep + call("noop", {})
    assert accepts(compiler, parallel, one) and accepts(compiler, parallel, two)
    assert accepts(compiler, single, call("noop", {}))
    assert not accepts(compiler, single, two)  # parallel_tool_calls false: one call
    for bad in [call("get_wether", GOOD),  # a name not in tools
                call("get_weather", {"city": "Paris"}),  # a required argument missing
                call("get_weather", {"city": "Paris", "unit": "k"}),  # not in the enum
                call("get_weather", {"city": "P" * 11, "unit": "c"}),  # over maxLength
                call("get_weather", {**GOOD, "extra": 1}),  # a property the schema does not have
                call("noop", {"a": 1}),
                call("get_weather", GOOD).replace("Paris", "Pa\x07is"),  # a raw control character: not JSON
                "Sure! " + one,  # text before the call
                one + " done",  # and after it
                ""]:  # no call at all
        assert not accepts(compiler, parallel, bad), bad
    # the parser reads back what the grammar allows
    parsed = parser.parse(two)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", GOOD), ("noop", {})]


def test_named_tool_allows_that_tool_once(compiler):
    g = tool_call_grammar(get_tool_parser("hermes"), [WEATHER], parallel=False).grammar
    assert accepts(compiler, g, hermes("get_weather", GOOD))
    assert not accepts(compiler, g, hermes("noop", {}))
    assert not accepts(compiler, g, hermes("get_weather", GOOD) + "\n" + hermes("get_weather", GOOD))


def test_a_bad_parameters_schema_names_its_tool():
    with pytest.raises(ToolSchemaError) as e:
        tool_call_grammar(get_tool_parser("hermes"), [NOOP, {"name": "x", "parameters": {"type": "nonsense"}}], True)
    assert e.value.index == 1
