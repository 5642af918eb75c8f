"""``specdec serve``: the OpenAI-compatible server on uvicorn (registered by specdec/cli.py)."""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from specdec.cli import add_engine_args, make_llm
from specdec.server.admission import POLICIES
from specdec.server.limits import RequestLimits
from specdec.server.memory import limit_malloc_arenas
from specdec.tool_parsers import PARSERS


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                              description="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics, /version.")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="sequences that may wait for a batch slot beyond --max-num-seqs running")
    g.add_argument("--queue-full-policy", choices=POLICIES, default="reject",
                   help="when the queue is full: answer 503 (reject) or hold the request until there is room (wait)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for admission under --queue-full-policy wait (then 503)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; then they end with an error")
    g.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a stream may wait for its client to read before it is aborted")
    g.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that parse, template and tokenize requests off the event loop")
    g.add_argument("--max-pending-prepares", type=int, default=64,
                   help="requests that may be parsed / tokenized or wait for it at once (then 503)")
    g.add_argument("--metrics-api-key", default=os.environ.get("SPECDEC_METRICS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /metrics (default: $SPECDEC_METRICS_API_KEY)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host header names to accept (e.g. localhost,127.0.0.1); default: any")
    g.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the format the model writes tool calls in (default: the one its chat template shows: "
                        "<tool_call> tags -> hermes, Llama 3 markers -> llama3_json)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served as models of their own, selected by model=NAME "
                        "(needs --enable-lora)")
    g.add_argument("--enable-lora-runtime-updates", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (loading only from --lora-allowed-dir)")
    g.add_argument("--lora-allowed-dir", action="append", default=[], metavar="DIR",
                   help="a folder runtime-loaded adapters may come from (repeatable)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, from opening or from its "
                        "previous response, however slowly it sends them (then it is closed)")
    g.add_argument("--max-connections", type=int, default=2048,
                   help="open connections; one more is answered 503 and closed")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection is kept open")
    g.add_argument("--max-header-bytes", type=int, default=16384,
                   help="bytes of a request line and headers (more is a 400)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("request limits (each breach is a 4xx naming the limit)")
    d = RequestLimits()
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds for a request body to arrive (then 408)")
    g.add_argument("--max-messages", type=int, default=d.max_messages)
    g.add_argument("--max-n", type=int, default=d.max_n)
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="the largest max_tokens / min_tokens a request may ask for (default: --max-model-len)")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    g.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    g.add_argument("--max-stop-length", type=int, default=d.max_stop_length, help="characters per stop string")
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids)
    g.add_argument("--max-schema-chars", type=int, default=d.max_schema_chars,
                   help="characters of each JSON schema / regex / grammar, and of all tool definitions together")


def settings_from_args(args, name: str):
    from specdec.server.app import ServerSettings
    from specdec.server.lora_models import parse_lora_modules

    for flag in ("max_connections", "max_header_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    for flag in ("write_timeout", "shutdown_timeout", "header_timeout", "keep_alive_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    limits = RequestLimits(max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                           max_messages=args.max_messages, max_n=args.max_n, max_tokens=args.max_tokens_limit,
                           max_logprobs=args.max_logprobs, max_stop=args.max_stop,
                           max_stop_length=args.max_stop_length, max_stop_token_ids=args.max_stop_token_ids,
                           max_schema_chars=args.max_schema_chars)
    return ServerSettings(model_name=name, api_key=args.api_key, metrics_api_key=args.metrics_api_key,
                          max_queue=args.max_queue, queue_full_policy=args.queue_full_policy,
                          max_waiting=args.max_waiting, limits=limits, write_timeout=args.write_timeout,
                          tokenizer_workers=args.tokenizer_workers, max_pending_prepares=args.max_pending_prepares,
                          shutdown_timeout=args.shutdown_timeout, engine_stop_timeout=args.shutdown_timeout + 10.0,
                          enable_docs=args.enable_docs, tool_call_parser=args.tool_call_parser,
                          allowed_hosts=[h for h in args.allowed_hosts.split(",") if h.strip()],
                          lora_modules=parse_lora_modules(args.lora_modules),
                          enable_lora_runtime_updates=args.enable_lora_runtime_updates,
                          lora_allowed_dirs=list(args.lora_allowed_dir))


def cmd_serve(args) -> int:
    """Serve until SIGTERM / SIGINT (exit 0 after the drain) or until the engine thread dies
    (exit 1, so that a supervisor such as systemd or Kubernetes restarts the process)."""
    import uvicorn

    from specdec.server.app import build_app
    from specdec.server.connection_guard import guarded_protocol

    limit_malloc_arenas()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("specdec.server")
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    settings = settings_from_args(args, args.served_model_name or args.model or "specdec-default")
    _check_open_files(args.max_connections, log)
    llm = make_llm(args)
    server = None

    def engine_died() -> None:
        log.error("the engine thread died; exiting with status 1 so that the supervisor restarts the server")
        server.should_exit = True

    settings.on_engine_death = engine_died
    app = build_app(llm.engine, settings)
    # uvicorn's own drain is the backstop: begin_drain ends every request at --shutdown-timeout
    http = guarded_protocol(args.header_timeout, args.max_connections, app.state.metrics.connection_refused)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=http,
                            timeout_keep_alive=args.keep_alive_timeout,
                            h11_max_incomplete_event_size=args.max_header_bytes,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5.0,
                            access_log=args.log_level == "debug")
    server = _uvicorn_server_class()(config, on_exit_signal=app.state.begin_drain)
    server.run()
    return 1 if app.state.async_engine.error is not None else 0


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a handled SIGTERM after shutting down, so the process dies of the
        signal (status 143); a graceful shutdown here is a clean exit, status 0. The first
        signal also starts the app's drain; signals after the server is done are ignored, so a
        second SIGTERM during teardown cannot turn the clean exit into a 143."""

        def __init__(self, config, on_exit_signal: Callable[[], None]):
            super().__init__(config)
            self._on_exit_signal = on_exit_signal
            self._loop = None

        async def startup(self, sockets=None) -> None:
            import asyncio

            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_exit_signal)  # a signal handler: not on the loop's stack
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)

    return Server


def _check_open_files(max_connections: int, log: logging.Logger) -> None:
    """Warn when the open-files limit, not --max-connections, would bound the connections (the
    server itself needs some descriptors: model files, pipes, the listening socket)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return
    if soft != resource.RLIM_INFINITY and max_connections > soft - 64:
        log.warning("--max-connections %d is above what the open-files limit (%d) allows; raise it "
                    "(ulimit -n) or lower --max-connections", max_connections, soft)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.server [serve flags]``: the same as ``specdec serve``, without the
    other subcommands' imports."""
    parser = argparse.ArgumentParser(prog="python -m specdec.server", description="specdec OpenAI-compatible server")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except ValueError as e:
        print(f"specdec serve: error: {e}", file=sys.stderr)
        return 2
