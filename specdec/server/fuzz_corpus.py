"""The fuzz corpus: hostile request bodies (each must be a 4xx in OpenAI's shape, or served),
values at the edges of what validation accepts (each must be served), and a seeded generator of
random OpenAI-shaped bodies (every field the endpoints know, values of every JSON type, huge
and non-finite numbers, lone surrogates) for soaks; the suite's hypothesis strategies draw from
the same kinds of values."""
from __future__ import annotations

import json
import random

CORPUS: list[tuple[str, bytes]] = [
    ("/v1/completions", b""), ("/v1/completions", b"null"), ("/v1/completions", b"[]"), ("/v1/completions", b"1"),
    ("/v1/completions", b'"x"'), ("/v1/completions", b"{"), ("/v1/completions", b"\xff\xfe"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": -Infinity}'),
    ("/v1/completions", b'{"prompt": "x", "n": 1e999}'),
    ("/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": "\\udc00"}'), ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'),
    ("/v1/completions", b'{"prompt": [[]]}'), ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", b'{"prompt": [-1]}'), ("/v1/completions", b'{"prompt": [' + b"1," * 300 + b"1]}"),
    ("/v1/completions", b'{"prompt": "x", "top_k": 9223372036854775808}'),
    ("/v1/completions", b'{"prompt": "x", "top_k": -9223372036854775809}'),
    ("/v1/completions", b'{"prompt": "x", "stop": [""]}'), ("/v1/completions", b'{"prompt": "x", "stop": []}'),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": 5}}'),
    ("/v1/completions", b'{"prompt": "x", "echo": true, "logprobs": 2}'),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": null}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "name": {"a": [1]}}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": 1}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": {"role": "user"}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": '
                             b'{"name": "f", "arguments": "{"}}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                             b'"function": {"name": "f", "parameters": {"$ref": "#"}}}], "tool_choice": "required"}'),
    ("/v1/completions", b'{"prompt": "x", "guided_json": {"$ref": "#"}}'),
    ("/v1/completions", b'{"prompt": "x", "guided_grammar": "root ::= root"}'),  # a grammar no token can start
]

# values at the edges of what validation accepts: each must be served (a 200), not crash a step
_EDGE = {"prompt": "def f(x):", "max_tokens": 3}
CORPUS_OK: list[tuple[str, dict]] = [("/v1/completions", {**_EDGE, **kw}) for kw in [
    {"top_k": 2**31 - 1}, {"seed": -(2**63)}, {"seed": 2**63 - 1, "n": 4}, {"repetition_penalty": 0.1},
    {"repetition_penalty": 10}, {"temperature": 2.0, "top_p": 1e-9}, {"min_p": 1.0}, {"temperature": 0},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"stop_token_ids": list(range(64))},
    {"stop": ["\u00e9" * 256] * 16}, {"logprobs": 20}, {"n": 16, "max_tokens": 2}, {"min_tokens": 3},
    {"prompt": [0], "max_tokens": 1}, {"prompt": "\ud83d\ude00 \u0000"}, {"max_tokens": None, "stream": True},
]] + [("/v1/chat/completions", {"messages": [{"role": r, "content": "x"} for r in ("system", "user")],
                                "max_tokens": 3, **kw})
      for kw in [{"logprobs": True, "top_logprobs": 20}, {"stream": True, "n": 3}, {"max_completion_tokens": 1},
                 {"response_format": {"type": "json_object"}, "stream": True},
                 {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}]]


_FIELDS_INT = ("n", "max_tokens", "top_k", "seed", "min_tokens", "logprobs", "best_of", "top_logprobs",
               "max_completion_tokens")
_FIELDS_UNIT = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_FIELDS_BOOL = ("stream", "ignore_eos", "echo", "return_token_ids", "skip_special_tokens", "use_speculation",
                "include_stop_str_in_output", "add_generation_prompt", "parallel_tool_calls")
_TEXTS = ["", "x", "def f(x):", "<|im_end|>", "\x00", "\U0001f600", "\udfff", "a" * 300, "{", "[ab]{1,3}", "("]
_CONSTRAINTS = [("guided_choice", ["a", "b"]), ("guided_regex", "[ab]{1,3}"), ("guided_regex", "("),
                ("guided_json", {"type": "object", "properties": {"a": {"type": "integer"}}}),
                ("guided_grammar", 'root ::= "x" root'), ("response_format", {"type": "json_object"}),
                ("structured_outputs", {"regex": "a{0,99999}"}), ("guided_json", {"$ref": "#"})]


def _junk(rng: random.Random):
    kind = rng.randrange(9)
    return [None, rng.random() < 0.5, rng.randint(-(2**70), 2**70), rng.choice([float("nan"), float("inf"), 1e308]),
            rng.choice(_TEXTS), "\ud800", [rng.randint(-3, 300) for _ in range(rng.randrange(4))],
            {"k": rng.randint(0, 9)}, rng.uniform(-1, 3)][kind]


def _value(rng: random.Random, name: str):
    if rng.random() < 0.2:
        return _junk(rng)
    if name in _FIELDS_INT:
        return rng.choice([0, 1, 2, 3, 4, 8, 17, 21, 2**31, -1])
    if name in _FIELDS_UNIT:
        return rng.choice([0.0, 0.5, 1.0, 1.5, 2.5, 1e-9, 50.0])
    return rng.random() < 0.5


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """One random request: (path, raw body), random in shape and values; the values distinct enough
    (a fresh regex / schema / choice list now and then) that content-keyed caches see new keys."""
    chat = rng.random() < 0.5
    body: dict = ({"messages": [{"role": rng.choice(["user", "system", "assistant", "robot"]),
                                 "content": rng.choice(_TEXTS + [f"hello {rng.randrange(10**6)}"])}
                                for _ in range(rng.randrange(1, 4))]}
                  if chat else {"prompt": rng.choice(_TEXTS + [[1, 2, 3], [[5]], f"text {rng.randrange(10**6)}"])})
    for name in rng.sample(_FIELDS_INT + _FIELDS_UNIT + _FIELDS_BOOL, rng.randrange(6)):
        body[name] = _value(rng, name)
    if rng.random() < 0.3:
        name, value = rng.choice(_CONSTRAINTS)
        if rng.random() < 0.5:  # a new grammar: a fresh choice list or regex
            name, value = rng.choice([("guided_choice", [f"c{rng.randrange(10**6)}", "d"]),
                                      ("guided_regex", f"(x|{rng.randrange(10**6)})")])
        body[name] = value
    if rng.random() < 0.2:
        body["stop"] = rng.choice([["s"] * 17, "\u00e9" * 300, [""], "x"])
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep requests short; huge values are in CORPUS
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
