"""The OpenAI-compatible HTTP server (``specdec serve``); see docs/SERVER.md.

request_body.py (read + strict JSON) -> prepare.py (limits.py, protocol.py, tokenizing, on
tokenizer_pool.py) -> serving.py (completions / chat) -> generation.py (one HTTP request's
engine requests, its mailbox.py) -> async_engine.py (the engine thread; step_isolation.py).
app.py wires routes (allowed_hosts.py), metrics.py exposes Prometheus, admission.py bounds
the queue, memory.py the allocator, cli.py runs uvicorn; soak.py is ``bench serve --soak``.
"""
