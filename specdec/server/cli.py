"""``specdec serve``: the OpenAI-compatible server on uvicorn (registered by specdec/cli.py)."""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import sys
import signal
import threading

from specdec.cli import add_engine_args, make_llm
from specdec.server.admission import POLICIES


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
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def cmd_serve(args) -> int:
    import uvicorn

    from specdec.server.app import ServerSettings, build_app

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("specdec.server")
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    llm = make_llm(args)
    name = args.served_model_name or args.model or "specdec-default"
    settings = ServerSettings(model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                              queue_full_policy=args.queue_full_policy,
                              engine_stop_timeout=args.shutdown_timeout + 10.0)
    app = build_app(llm.engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug")
    # SIGINT/SIGTERM: stop accepting, drain open requests, lifespan shutdown (engine thread joined)
    _uvicorn_server_class()(config).run()
    return 0


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a handled SIGTERM after shutting down, so the process dies of the
        signal (status 143); a graceful shutdown here is a clean exit, status 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


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
