"""Connections on a raw socket, against a real server (uvicorn) with a short --header-timeout
and a small --max-connections: headers dribbled slowly or never sent are cut at the header
timeout; a connection over the cap gets a 503 in OpenAI's shape while the open ones, /health
included, are served; a body cut short by its client is a quiet, counted 499. Plus the outside
fuzzer's reproducers: masked-token logprobs answer 200 in strict JSON, stream or not, with
nothing in the server's log."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from specdec.server.fuzz import check_answer

HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def guarded(server_process, tiny_model, tmp_path_factory):
    srv = server_process(tiny_model, ["--header-timeout", str(HEADER_TIMEOUT), "--max-connections",
                                      str(MAX_CONNECTIONS)], tmp_path_factory.mktemp("guarded") / "server.log")
    try:
        yield srv.wait_ready()
    finally:
        assert srv.terminate() == 0, srv.log_tail()


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return s


def _closed_after(s: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``s`` (recv returns b"" or the connection resets)."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def _assert_quiet_log(srv) -> None:
    log = srv.log_path.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_headers_sent_slowly_or_never_are_cut_at_the_header_timeout(guarded):
    silent = _connect(guarded)
    dribbler = _connect(guarded)
    dribbler.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < HEADER_TIMEOUT * 3:  # a header line every 0.25 s: never idle
        try:
            dribbler.sendall(b"X-Slow: 1\r\n")
        except OSError:
            closed = True
            break
        time.sleep(0.25)
        dribbler.settimeout(0.01)
        try:
            if dribbler.recv(4096) == b"":
                closed = True
                break
        except socket.timeout:
            pass
        except OSError:
            closed = True
            break
    elapsed = time.monotonic() - t0
    assert closed and HEADER_TIMEOUT - 0.5 <= elapsed <= HEADER_TIMEOUT + 1.5, elapsed
    assert _closed_after(silent, HEADER_TIMEOUT * 3) <= HEADER_TIMEOUT + 1.5
    silent.close()
    dribbler.close()
    # a keep-alive connection gets the same time for its next request's headers
    with httpx.Client(base_url=guarded.url) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health").status_code == 200  # the same connection, reused


def test_a_connection_over_the_cap_gets_a_503_and_the_open_ones_are_served(guarded):
    with httpx.Client(base_url=guarded.url, limits=httpx.Limits(max_connections=1)) as client:
        assert client.get("/health").json() == {"status": "ok"}  # holds one of the places
        held = [_connect(guarded) for _ in range(MAX_CONNECTIONS - 1)]
        time.sleep(0.2)
        extra = _connect(guarded)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(5)
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower(), answer
        err = json.loads(body)["error"]
        assert err["code"] == "too_many_connections" and "--max-connections" in err["message"]
        # meanwhile the connections already open are served
        assert client.get("/health").json() == {"status": "ok"}
        for s in held:
            s.close()
        extra.close()
        time.sleep(0.3)
    with httpx.Client(base_url=guarded.url) as fresh:  # places freed: new connections are served again
        assert fresh.get("/health").status_code == 200
    assert guarded.metrics()["specdec:connections_refused_total"] >= 1


def test_a_body_cut_short_by_its_client_is_a_quiet_counted_499(guarded):
    before = guarded.metrics().get('specdec:request_rejected_total{status="499"}', 0)
    for _ in range(3):
        s = _connect(guarded)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\":")
        time.sleep(0.1)
        s.close()
    deadline = time.monotonic() + 5
    while guarded.metrics().get('specdec:request_rejected_total{status="499"}', 0) < before + 3:
        assert time.monotonic() < deadline, guarded.metrics()
        time.sleep(0.1)
    assert guarded.metrics().get('specdec:request_rejected_total{status="500"}', 0) == 0
    _assert_quiet_log(guarded)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 2, "guided_choice": ["a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                              "top_logprobs": 4, "response_format": {"type": "json_object"}}),
])
def test_masked_logprob_reproducers_answer_200_in_strict_json(guarded, path, body):
    with httpx.Client(base_url=guarded.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        for stream in (False, True, False):  # one keep-alive connection throughout
            r = client.post(path, json={**body, "stream": stream})
            assert r.status_code == 200, r.text
            check_answer(path, r.status_code, r.headers["content-type"], r.content)
            assert "-9999.0" in r.text and "Infinity" not in r.text and "NaN" not in r.text
    _assert_quiet_log(guarded)
