"""Start a specdec server as a child process on a free loopback port (bench serve, scripts).

``SpawnedServer`` is a context manager: it starts ``python -m specdec.server``, waits for
/health, and on exit sends SIGTERM (graceful) and then, if it must, SIGKILL.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(url: str) -> None:
    """Raise ValueError unless every address ``url``'s host resolves to is a loopback one."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    remote = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if remote:
        raise ValueError(f"bench serve only targets this machine (loopback); {host!r} resolves to {remote}")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags (as in ``specdec.cli.add_engine_args``) whose values differ from
    their defaults, so a child server is configured like this process was asked to be."""
    from specdec.cli import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


class SpawnedServer:
    def __init__(self, argv: list[str], extra_args: str = "", api_key: str | None = None,
                 log_path: str | None = None, ready_timeout: float = 900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "specdec.server", *argv, *shlex.split(extra_args),
                    "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if api_key:
            self.env["SPECDEC_API_KEY"] = api_key  # not on the command line, where ps shows it
        self.log_path = log_path or tempfile.mkstemp(prefix="specdec-serve-", suffix=".log")[1]
        self.ready_timeout = ready_timeout
        self.ready_s = 0.0
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SpawnedServer:
        self._log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {self.ready_timeout:.0f} s; log {self.log_path}")

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-num_chars:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
