"""``python -m specdec.server.fuzz``: the server's contract under fire, outside the suite.

- ``schemathesis [--examples 150]``: schemathesis (a test dependency) builds requests from
  /openapi.json, positive and negative, ``--examples`` per operation and mode, and sends them to
  the app in this process; each answer must be no 5xx, declared (status, content type, schema),
  negative bodies refused with a 4xx, and strict JSON (bodies and every stream chunk).
- ``soak --minutes 10``: a ``specdec serve`` child process gets the fuzz corpus (fuzz_corpus.py)
  from a few concurrent clients for that long; its resident memory is reported after the first
  minute and at the end (the goal: the end within 5% of the first minute's), with the answers'
  statuses; a 5xx or a malformed answer fails it.

Both take the engine flags of ``specdec serve`` (``--model``, ``--dtype``, ...); without
``--model`` the embedded default model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from specdec.server import response_models as rm

ANSWER_MODELS = {"/v1/completions": (rm.CompletionResponse, rm.CompletionChunk),
                 "/v1/chat/completions": (rm.ChatCompletionResponse, rm.ChatCompletionChunk),
                 "/v1/models": (rm.ModelList, None), "/health": (rm.Health, None), "/version": (rm.Version, None)}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str | bytes):
    """RFC 8259 JSON only: NaN / Infinity / -Infinity are errors, as in JavaScript's JSON.parse."""
    return json.loads(text, parse_constant=_reject_constant)


def sse_events(text: str) -> list[dict]:
    """Every event of a stream, strictly parsed; it must end with [DONE]."""
    data = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        raise ValueError(f"the stream does not end with data: [DONE]: {text[-300:]!r}")
    return [loads_strict(d) for d in data[:-1]]


def check_answer(path: str, status: int, content_type: str, content: bytes) -> list[dict]:
    """Validate one answer: strict JSON, then its response model (an error: ErrorResponse; a
    stream: each chunk). Returns the body, or the stream's chunks; raises on a violation."""
    body_model, chunk_model = ANSWER_MODELS.get(path, (None, None))
    if status >= 400:
        body = loads_strict(content)
        rm.ErrorResponse.model_validate(body)
        return [body]
    if content_type.startswith("text/plain"):
        return []
    if content_type.startswith("text/event-stream"):
        chunks = sse_events(content.decode("utf-8"))
        for c in chunks:
            (rm.ErrorResponse if "error" in c else chunk_model).model_validate(c)
        return chunks
    body = loads_strict(content)
    if body_model is not None:
        body_model.model_validate(body)
    return [body]


def strict_json_check(ctx, response, case) -> None:
    """A schemathesis check: ``check_answer`` on its response."""
    ct = response.headers.get("content-type")
    ct = (ct[0] if isinstance(ct, list) else ct) or ""
    check_answer(case.operation.path, response.status_code, ct, response.content)


def run_schemathesis(app, examples: int) -> Counter:
    """Every operation of ``app``'s /openapi.json, positive and negative, ``examples`` each;
    returns the statuses seen; raises schemathesis' failure group on the first failing case."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    statuses: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def one(case):
                if case.method == "POST" and isinstance(case.body, dict):
                    case.headers = {**(case.headers or {}), "Content-Type": "application/json"}
                response = case.call_and_validate(excluded_checks=[positive_data_acceptance],
                                                  additional_checks=[strict_json_check])
                statuses[(operation.label, mode.value, response.status_code)] += 1

            try:
                one()
            except Unsatisfiable:  # nothing to negate: a GET without parameters
                if mode is GenerationMode.POSITIVE:
                    raise
    return statuses


def _cmd_schemathesis(args) -> int:
    from schemathesis.python import asgi

    from specdec.cli import make_llm
    from specdec.server.cli import settings_from_args
    from specdec.server.app import build_app

    args.enable_docs = True
    app = build_app(make_llm(args).engine, settings_from_args(args, args.served_model_name or "specdec"))
    t0 = time.monotonic()
    try:
        statuses = run_schemathesis(app, args.examples)
    finally:
        asgi.shutdown_lifespans()
    by_op: dict = {}
    for (label, mode, status), n in sorted(statuses.items()):
        by_op.setdefault((label, mode), {})[status] = n
    for (label, mode), counts in by_op.items():
        print(f"{label:28s} {mode:9s} {sum(counts.values()):5d} requests  statuses {dict(sorted(counts.items()))}")
    print(f"schemathesis: {sum(statuses.values())} requests in {time.monotonic() - t0:.0f} s; no failure")
    return 0


def main(argv: list[str] | None = None) -> int:
    from specdec.cli import add_engine_args
    from specdec.server.cli import add_server_args
    from specdec.server.soak_fuzz import add_soak_args, cmd_soak

    parser = argparse.ArgumentParser(prog="python -m specdec.server.fuzz", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("schemathesis", help="schema-driven fuzzing of the in-process app")
    p.add_argument("--examples", type=int, default=150, help="examples per operation and generation mode")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=_cmd_schemathesis)
    p = sub.add_parser("soak", help="the fuzz corpus against a server process; its RSS over time")
    add_soak_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_soak)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
