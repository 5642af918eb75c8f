"""A speculative (n-gram, K=3) server: same greedy text as the plain server, and the
speculative-decoding counters show up in /metrics and in the usage extension."""
from __future__ import annotations

import json

import httpx

# repetitive text gives the n-gram proposer matches to draft from
PROMPT = "a = b + c\na = b + c\na = b + c\na = b + c\n"


def test_greedy_text_equals_plain_server_and_counters_move(server, spec_server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    before = spec_server.metrics()
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    spec = httpx.post(spec_server.url + "/v1/completions", json=body, headers=spec_server.headers, timeout=60).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]  # lossless (float32, greedy)
    stats = spec["usage"]["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert plain["usage"]["spec_decode"]["num_drafts"] == 0

    after = spec_server.metrics()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"specdec:spec_decode_{name}_total" in after
    drafts = after["specdec:spec_decode_num_drafts_total"] - before.get("specdec:spec_decode_num_drafts_total", 0)
    assert drafts == stats["num_drafts"]
    accepted = after["specdec:spec_decode_num_accepted_tokens_total"] - before.get(
        "specdec:spec_decode_num_accepted_tokens_total", 0)
    assert accepted == stats["num_accepted_tokens"]
    per_pos = {k: v for k, v in after.items() if k.startswith("specdec:spec_decode_num_accepted_tokens_per_pos")}
    assert set(per_pos) == {f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'
                            for p in range(3)}
    assert sum(per_pos.values()) == after["specdec:spec_decode_num_accepted_tokens_total"]


def test_speculative_stream_with_usage(spec_server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.7, "seed": 4, "ignore_eos": True}
    full = httpx.post(spec_server.url + "/v1/completions", json=body, headers=spec_server.headers, timeout=60).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", spec_server.url + "/v1/completions", json=stream_body, headers=spec_server.headers,
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 32
    assert set(usage["spec_decode"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                         "acceptance_rate", "mean_acceptance_length"}
    m = spec_server.wait_idle()
    assert m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"]


def test_constrained_greedy_text_equals_plain_server(server, spec_server):
    """A grammar masks drafts and verification rows alike: greedy output under a constraint is
    the plain server's, token for token, while drafts are still proposed and verified."""
    import re

    regex = r"((a = b \+ c|x = y)\n){12}"  # twelve lines, each the model's choice
    constraints = [{"guided_regex": regex},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
                       "type": "object", "properties": {"a": {"enum": ["b + c", "d"]}, "n": {"type": "integer"}},
                       "required": ["a", "n"]}}}}]
    for constraint in constraints:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, **constraint}
        plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        spec = httpx.post(spec_server.url + "/v1/completions", json=body, headers=spec_server.headers,
                          timeout=60).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"], constraint
        assert spec["usage"]["spec_decode"]["num_drafts"] > 0, (constraint, spec["choices"][0]["text"])
    assert re.fullmatch(regex, httpx.post(spec_server.url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "guided_regex": regex},
        headers=spec_server.headers, timeout=60).json()["choices"][0]["text"])


def test_one_request_s_time_split_from_metrics(spec_server):
    """serve-peers reads a request's prefill / decode split from /metrics around it (one at a time)."""
    from specdec.bench.serve_timings import scrape, specdec_timings

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60, headers=spec_server.headers) as client:
        before = scrape(client, spec_server.url)
        out = client.post(spec_server.url + "/v1/completions", json=body).json()
        after = scrape(client, spec_server.url)
    usage = out["usage"]
    t = specdec_timings(before, after, usage["prompt_tokens"], usage["completion_tokens"], client_s=60.0)
    assert t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"] and t["prompt_n"] >= 1
    assert t["steps"]["prefill"]["steps"] == 1  # the whole prompt in one step, its first token with it
    # every later token came from a decode step, several per step where drafts were accepted
    decode = t["steps"]["decode"]
    assert decode["steps"] + t["num_accepted_tokens"] == usage["completion_tokens"] - 1
    assert t["num_drafts"] == usage["spec_decode"]["num_drafts"] <= decode["steps"]
    assert decode["tokens"] == decode["steps"] + usage["spec_decode"]["num_draft_tokens"]
    assert 0 < t["prompt_ms"] and 0 < t["predicted_ms"] and t["prompt_ms"] + t["predicted_ms"] <= t["server_ms"]
    assert t["engine_other_ms"] >= 0
