"""Request fields -> SamplingParams.structured_outputs and the tool plan, through the real
Preparer (no server): response_format, structured_outputs, guided_*, tools and tool_choice;
every refusal is a 400 naming the field."""
from __future__ import annotations

import copy
import json

import pytest

from specdec.server.limits import RequestLimits
from specdec.server.prepare import Preparer
from specdec.server.protocol import APIError
from specdec.server.structured import engine_error_param
from specdec.structured_output.backend import GrammarBackend
from specdec.tool_parsers import HermesToolParser

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
USER = [{"role": "user", "content": "hi"}]
GRAMMARS: GrammarBackend | None = None


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer, hermes_template):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = hermes_template
    return tok


@pytest.fixture(scope="module", autouse=True)
def _grammar_backend(tiny_tokenizer):
    global GRAMMARS
    GRAMMARS = GrammarBackend(tiny_tokenizer, len(tiny_tokenizer), (tiny_tokenizer.eos_token_id,))


def preparer(tool_parser=HermesToolParser(), **limits) -> Preparer:
    """The server's Preparer, compiling grammars with the engine's backend for the tiny tokenizer."""
    return Preparer(RequestLimits(**limits), ["tiny"], 256, 320, 64, 8, lambda ids: None, GRAMMARS.compile,
                    tool_parser)


def chat(tokenizer, prep=None, **body):
    return (prep or preparer()).chat(tokenizer, json.dumps({"messages": USER, **body}).encode())


def completion(tokenizer, **body):
    return preparer().completion(tokenizer, json.dumps({"prompt": "x", **body}).encode())


def refused(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("fields,kind,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json", "response_format"),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json", "structured_outputs"),
    ({"guided_json": SCHEMA}, "json", "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json", "guided_json"),
    ({"guided_regex": "[0-9]{3}"}, "regex", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar", "guided_grammar"),
])
def test_constraint_fields_map_to_structured_outputs(tokenizer, fields, kind, field):
    for prep in (chat(tokenizer, **fields), completion(tokenizer, **fields)):
        so = prep.params.structured_outputs
        assert so.kind == kind and prep.constraint_field == field
        if kind == "json":
            assert json.loads(so.json) == SCHEMA
    assert chat(tokenizer, **fields).tool_parser is None  # no tools: nothing to parse


def test_text_response_format_is_unconstrained(tokenizer):
    prep = chat(tokenizer, response_format={"type": "text"})
    assert prep.params.structured_outputs is None and prep.constraint_field is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "json": SCHEMA}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema"),  # not an object
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"guided_choice": "yes"}, "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(tokenizer, fields, param):
    assert refused(chat, tokenizer, **fields).param == param
    assert refused(completion, tokenizer, **fields).param == param


def test_the_engine_compile_check_runs_before_admission(tokenizer):
    seen = []

    def compile_grammar(params):
        seen.append(params.kind)
        raise ValueError("structured_outputs.regex: no such thing")

    prep = preparer()
    prep.compile_grammar = compile_grammar
    e = refused(chat, tokenizer, prep, guided_regex="a+")
    assert e.param == "guided_regex" and "no such thing" in e.message and seen == ["regex"]
    assert refused(chat, tokenizer, prep, structured_outputs={"regex": "a"}).param == "structured_outputs.regex"
    chat(tokenizer, prep)  # unconstrained: nothing to compile
    assert seen == ["regex", "regex"]


def test_schema_and_tools_over_the_size_limit(tokenizer):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    prep = preparer(max_schema_chars=500)
    e = refused(chat, tokenizer, prep, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": big}})
    assert (e.param, e.code) == ("response_format.json_schema.schema", "limit_exceeded")
    assert "--max-schema-chars" in e.message
    assert refused(chat, tokenizer, prep, guided_regex="a" * 501).param == "guided_regex"
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    assert refused(chat, tokenizer, prep, tools=[tool]).param == "tools"
    chat(tokenizer, prep, guided_regex="a" * 400)  # under the limit


def test_tools_reach_the_template_and_auto_parses(tokenizer):
    prep = chat(tokenizer, tools=[WEATHER, NOOP])
    prompt = tokenizer.decode(prep.prompt_ids[0])
    assert '"name": "get_weather"' in prompt and "the weather in a city" in prompt
    assert prep.params.structured_outputs is None  # auto: unconstrained
    assert prep.tool_parser.name == "hermes"
    none = chat(tokenizer, tools=[WEATHER], tool_choice="none")
    assert none.tool_parser is None and none.prompt_ids == chat(tokenizer, tools=[WEATHER]).prompt_ids


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "noop"}}, True)])
def test_required_and_named_tool_choice_set_a_grammar(tokenizer, tool_choice, parallel):
    prep = chat(tokenizer, tools=[WEATHER, NOOP], tool_choice=tool_choice, parallel_tool_calls=parallel)
    so = prep.params.structured_outputs
    assert so.kind == "grammar" and prep.constraint_field == "tool_choice"
    assert '\\"noop\\"' in so.grammar
    assert ('\\"get_weather\\"' in so.grammar) == (tool_choice == "required")


def test_assistant_tool_calls_and_tool_results_reach_the_template(tokenizer):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prep = chat(tokenizer, messages=messages, tools=[WEATHER])
    prompt = tokenizer.decode(prep.prompt_ids[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "tool: [call_1] sunny" in prompt
    long_args = json.dumps({"city": "x" * 256 * 8})  # more characters than 256 tokens of 8 can hold
    messages[1]["tool_calls"][0]["function"]["arguments"] = long_args
    assert refused(chat, tokenizer, messages=messages).param == "messages"
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris}"
    assert refused(chat, tokenizer, messages=messages).param == "messages.1.tool_calls.0.function.arguments"
    messages[1]["tool_calls"][0]["function"]["arguments"] = "[1]"
    assert refused(chat, tokenizer, messages=messages).param == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [NOOP, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [NOOP], "functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tokenizer, fields, param):
    assert refused(chat, tokenizer, **fields).param == param


def test_tools_without_a_known_format_need_a_parser_flag(tokenizer):
    """"auto" needs the model's own format; "required" and a named tool work without one (the JSON form)."""
    e = refused(chat, tokenizer, preparer(tool_parser=None), tools=[WEATHER])
    assert e.param == "tool_choice" and "--tool-call-parser" in e.message
    assert chat(tokenizer, preparer(tool_parser=None), tools=[WEATHER], tool_choice="none").tool_parser is None


def test_serve_flags():
    import argparse

    from specdec.server.cli import add_server_args, settings_from_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    settings = settings_from_args(parser.parse_args(["--tool-call-parser", "llama3_json", "--max-schema-chars", "99"]),
                                  "m")
    assert settings.tool_call_parser == "llama3_json" and settings.limits.max_schema_chars == 99
    assert settings_from_args(parser.parse_args([]), "m").tool_call_parser is None  # from the template
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "no_such_format"])
    with pytest.raises(ValueError, match="max-schema-chars"):
        settings_from_args(parser.parse_args(["--max-schema-chars", "0"]), "m")


def test_engine_grammar_errors_name_the_request_field():
    message = "structured_outputs.json: cannot compile the schema"
    assert engine_error_param(message, "response_format") == "response_format.json_schema.schema"
    assert engine_error_param("structured_outputs.grammar: bad", "tool_choice") == "tool_choice"
    assert engine_error_param(message, "structured_outputs") == "structured_outputs.json"
    assert engine_error_param(message, None) is None
    assert engine_error_param("SamplingParams.top_p must be ...", "guided_json") is None
