"""The OpenAI-compatible HTTP server (``specdec serve``); see docs/SERVER.md.

protocol.py (request models, errors) -> serving.py (completions / chat) -> generation.py
(one HTTP request's engine requests) -> async_engine.py (the engine thread); app.py wires
routes, metrics.py exposes Prometheus, admission.py bounds the queue, cli.py runs uvicorn.
"""
