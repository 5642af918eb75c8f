"""Real server processes on loopback, sharing one tiny random checkpoint per session.

Two long-lived servers start together (their model loads overlap): a plain one and a
speculative (n-gram) one that requires an API key. Engine flags keep a 2-core machine
quick: float32, one thread, a 256-token context, a small KV pool.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256
ENGINE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory", "8000000", "--max-num-seqs", "64", "--log-level", "warning"]
SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 3}'
# a small Hermes-style chat template (Qwen2.5's tool-call format) for the tiny tokenizer
HERMES_TEMPLATE = (
    "{%- if tools %}<|bos|>system: You may call these functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>\n{% endif %}'
    "{% for m in messages %}<|bos|>{{ m['role'] }}: "
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}] {% endif %}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, extra_args: list[str], log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.metrics_headers: dict = {}  # set when the server has --metrics-api-key
        self.max_model_len = MAX_MODEL_LEN
        self.log_path = log_path
        args = [sys.executable, "-m", "specdec.server", "--model", str(model), "--port", str(self.port),
                "--served-model-name", "tiny", *ENGINE_ARGS, *extra_args]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value, with the model_name label dropped for brevity."""
        text = httpx.get(self.url + "/metrics", headers=self.metrics_headers, timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until nothing runs, waits or holds a KV block; return the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["specdec:num_requests_running"] == 0 and m["specdec:num_requests_waiting"] == 0
                    and m["specdec:num_requests_in_flight"] == 0
                    and m["specdec:kv_cache_free_blocks"] == m["specdec:kv_cache_total_blocks"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="session")
def tiny_model(make_model) -> Path:
    return Path(make_model("server_llama", arch="llama"))


@pytest.fixture(scope="session")
def hermes_template() -> str:
    return HERMES_TEMPLATE


@pytest.fixture(scope="session")
def server_process() -> type[ServerProcess]:
    """The class, for modules that start a server on a checkpoint of their own."""
    return ServerProcess


@pytest.fixture(scope="session")
def _servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    plain = ServerProcess(tiny_model, [], logs / "plain.log")
    spec = ServerProcess(tiny_model, ["--speculative-config", SPEC_CONFIG], logs / "spec.log", api_key=API_KEY)
    try:
        yield plain.wait_ready(), spec.wait_ready()
    finally:
        codes = plain.terminate(), spec.terminate()
    assert codes == (0, 0), f"servers exited with {codes}:\n{plain.log_tail()}\n{spec.log_tail()}"


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    return _servers[0]


@pytest.fixture(scope="session")
def spec_server(_servers) -> ServerProcess:
    return _servers[1]


@pytest.fixture
def make_server(tiny_model, tmp_path):
    """make_server(extra_args) -> a ready ServerProcess of its own, terminated after the test."""
    started = []

    def make(extra_args: list[str]) -> ServerProcess:
        srv = ServerProcess(tiny_model, extra_args, tmp_path / f"server{len(started)}.log")
        started.append(srv)
        return srv.wait_ready()

    yield make
    for srv in started:
        srv.terminate()


# the in-process app's limits: small, so schema-driven requests stay quick (the schema states them)
INPROC_LIMITS = {"max_tokens": 4, "max_n": 2, "max_logprobs": 5, "max_stop": 4, "max_messages": 8,
                 "max_stop_token_ids": 4, "max_body_bytes": 1 << 16}


class SessionLifespan:
    """The app, with its lifespan (engine thread, tokenizer pool) run once for the whole session:
    schemathesis' pytest plugin ends ASGI lifespans after every test, and the app's cannot restart."""

    def __init__(self, app):
        self.app, self.state, self._context = app, app.state, None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        await receive()  # lifespan.startup
        if self._context is None:
            self._context = self.app.router.lifespan_context(self.app)
            await self._context.__aenter__()
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown: the session's end does it (close)
        await send({"type": "lifespan.shutdown.complete"})

    def close(self) -> None:
        import asyncio

        if self._context is not None:  # its exit only joins threads: any event loop will do
            asyncio.run(self._context.__aexit__(None, None, None))


@pytest.fixture(scope="session")
def asgi_app(tiny_model, hermes_template):
    """The app in this process (no uvicorn, no sockets), on the tiny model with a tool-call chat
    template and ``--enable-docs``; requests go through schemathesis' ASGI client, whose event
    loop (one per process) runs the app's lifespan once for the session."""
    from specdec import LLM
    from specdec.server.app import ServerSettings, build_app
    from specdec.server.limits import RequestLimits

    llm = LLM(model=str(tiny_model), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=8_000_000,
              max_num_seqs=16, num_threads=1)
    llm.engine.tokenizer.chat_template = hermes_template
    app = SessionLifespan(build_app(llm.engine, ServerSettings("tiny", enable_docs=True,
                                                               limits=RequestLimits(**INPROC_LIMITS))))
    yield app
    app.close()


@pytest.fixture
def asgi_client(asgi_app):
    from schemathesis.python import asgi

    with asgi.get_client(asgi_app) as client:
        yield client
