"""``specdec bench serve`` against the live test server; its refusal of non-loopback hosts."""
from __future__ import annotations

import json

import pytest

from specdec.bench.serve import main, percentile
from specdec.server.launcher import check_loopback, engine_argv
from specdec.server.metrics import parse_spec_counters


def test_bench_serve_reports_throughput_latency_and_acceptance(spec_server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--url", spec_server.url, "--api-key", spec_server.api_key, "--concurrency", "1", "3",
               "--num-prompts", "6", "--output-len", "12", "--input-len", "24", "--num-warmup", "1",
               "--output-json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "out tok/s" in table and "TTFT p50 ms" in table and "mean acc len" in table
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["cut_by_deadline"] == 0
        assert r["output_tokens"] == 6 * 12
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert r["num_drafts"] > 0  # scraped from the n-gram server's /metrics
        assert 0 <= r["acceptance_rate"] <= 1 and r["mean_acceptance_length"] >= 1


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://192.168.0.1", "http://8.8.8.8:80"])
def test_non_loopback_targets_are_refused(url):
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(url)
    assert main(["--url", url, "--num-prompts", "1"]) == 2


def test_loopback_targets_pass():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1234")


def test_engine_argv_forwards_only_changed_flags():
    import argparse

    from specdec.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "m", "--max-num-seqs", "8", "--no-prefix-caching",
                         "--speculative-config", '{"method": "ngram"}'])
    assert engine_argv(args) == ["--model", "m", "--max-num-seqs", "8", "--no-prefix-caching",
                                 "--speculative-config", '{"method": "ngram"}']


def test_percentile_and_metrics_parsing():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    text = ('specdec:spec_decode_num_drafts_total{model_name="m"} 4.0\n'
            'specdec:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0\n'
            'specdec:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0\n')
    parsed = parse_spec_counters(text)
    assert parsed["num_drafts"] == 4.0 and parsed["per_pos"] == [3.0, 2.0]


def test_soak_finds_nothing_lost_or_leaked_on_the_live_server(server):
    """A small soak (8 streams x (1 warm-up + 1 round), 2 disconnects, a stalled reader) against
    the shared server: its own checks pass and its accounting matches the server's counters."""
    import asyncio

    from specdec.bench.soak import run_soak

    report = asyncio.run(run_soak(server.url, {}, "tiny", ["def f(x):"], server.proc.pid, concurrency=8, rounds=1,
                                  num_disconnects=2, max_tokens=24, stall_max_tokens=180))
    checks = dict(report["checks"])
    checks.pop("preemption_happened")  # the shared server's KV pool is big enough for 8 streams
    checks.pop("rss_within_5pct_of_warmup", None)  # one short round says nothing about memory
    assert all(checks.values()), report
    for r in report["rounds"]:
        assert (r["completed"], r["disconnected"], r["lost"]) == (6, 2, 0)
        assert r["server_success"] + r["server_aborted"] == 6 + 2 + 1
    assert report["latency"]["ttft_ms_p50"] > 0 and report["latency"]["itl_ms_p50"] > 0
