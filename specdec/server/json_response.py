"""Strict JSON out: every body and stream chunk the server writes is RFC 8259 JSON.

``json.dumps`` writes ``NaN`` / ``Infinity`` / ``-Infinity`` by default, which JavaScript's
``JSON.parse`` and other strict parsers reject; here a non-finite float is a ``ValueError``
at the server instead (a bug to fix where the value is made, e.g. ``finite_logprob``).
"""
from __future__ import annotations

import json

from starlette.responses import JSONResponse


def dumps_strict(content) -> str:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return dumps_strict(content).encode("utf-8")
