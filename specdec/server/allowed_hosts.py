"""AllowedHosts: answer 400 to a request whose Host header is not on ``--allowed-hosts``.

A page on another site can make a browser send requests to a local server by pointing its
own name at 127.0.0.1 (DNS rebinding); the browser then sends that name as the Host, which
this check refuses. Pure ASGI (no BaseHTTPMiddleware, which would sit between a stream and
its client's disconnect); the error has OpenAI's shape.
"""
from __future__ import annotations

import json


def host_name(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class AllowedHosts:
    def __init__(self, app, hosts: list[str]):
        self.app = app
        self.hosts = {host_name(h) for h in hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if host_name(host) not in self.hosts:
                body = json.dumps({"error": {"message": f"the Host header {host[:100]!r} is not in this server's "
                                                        "--allowed-hosts", "type": "invalid_request_error",
                                             "param": None, "code": "host_not_allowed"}}).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
