"""Prometheus metrics for ``specdec serve``, on the server's own CollectorRegistry.

Two kinds: engine state (speculative-decoding counters, KV cache, queue sizes) is read
at scrape time from the snapshot the engine thread publishes after every step, so the
HTTP thread never touches the engine; per-request counters and latency histograms are
prometheus_client objects (thread-safe) updated where the event happens.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specdec:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Yields engine-side metrics from ``snapshot()`` (engine.get_metrics() plus server gauges)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str):
        self.snapshot = snapshot
        self.labels = {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value, extra_labels: dict | None = None):
        labels = {**self.labels, **(extra_labels or {})}
        fam = cls(PREFIX + name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), value)
        return fam

    def collect(self):
        s = self.snapshot()
        if not s:
            return
        c, g = CounterMetricFamily, GaugeMetricFamily
        yield self._family(c, "spec_decode_num_drafts", "Verification steps that carried draft tokens.",
                           s.get("num_drafts", 0))
        yield self._family(c, "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.get("num_draft_tokens", 0))
        yield self._family(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           s.get("num_accepted_tokens", 0))
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=[*self.labels, "position"])
        for pos, n in enumerate(s.get("num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([*self.labels.values(), str(pos)], n)
        yield per_pos
        yield self._family(c, "spec_decode_num_emitted_tokens", "Tokens emitted by verification steps.",
                           s.get("num_emitted_tokens", 0))
        yield self._family(g, "kv_cache_usage_perc", "Fraction of the KV cache's memory in use (0..1): every "
                           "group's blocks, by their bytes.", s.get("kv_cache_usage", 0.0))
        yield self._family(g, "kv_cache_free_blocks", "Free KV-cache blocks.", s.get("num_free_kv_blocks", 0))
        yield self._family(g, "kv_cache_total_blocks", "All KV-cache blocks.", s.get("num_kv_blocks", 0))
        yield from self._kv_groups(s.get("kv_cache_groups", {}))
        yield from self._step_timings(s.get("step_timings", {}))
        yield self._family(g, "num_requests_running", "Sequences in the running batch.", s.get("num_running", 0))
        yield self._family(g, "num_requests_waiting", "Sequences waiting for a batch slot.", s.get("num_waiting", 0))
        yield self._family(g, "num_requests_in_flight", "Prompts submitted to the engine and not yet finished.",
                           s.get("num_in_flight", 0))
        yield self._family(c, "num_preemptions", "Sequences preempted for lack of KV blocks.",
                           s.get("num_preemptions", 0))
        yield self._family(g, "admission_in_use", "Admission slots (sequences) held by requests.",
                           s.get("admission_in_use", 0))
        yield self._family(g, "admission_waiting", "Requests waiting for admission slots (policy 'wait').",
                           s.get("admission_waiting", 0))

    def _kv_groups(self, groups: dict):
        """Per KV cache group (``engine/kv_layout.py``: one per attention window of a hybrid model)."""
        label = "kv_cache_group"
        for name, doc, key in (("kv_cache_group_usage_perc", "Fraction of a KV cache group's blocks in use (0..1).",
                                "usage"),
                               ("kv_cache_group_free_blocks", "Free blocks of a KV cache group.", "num_free_blocks"),
                               ("kv_cache_group_total_blocks", "All blocks of a KV cache group.", "num_blocks")):
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=[*self.labels, label])
            for group, stats in groups.items():
                fam.add_metric([*self.labels.values(), group], stats[key])
            yield fam

    def _step_timings(self, phases: dict):
        """Engine steps and their seconds by phase and part (``engine/step_timings.py``)."""
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps, by phase (prefill: the step "
                                    "computes prompt tokens).", labels=[*self.labels, "phase"])
        rows = CounterMetricFamily(PREFIX + "engine_step_tokens", "Target rows the engine steps scheduled, "
                                   "by phase.", labels=[*self.labels, "phase"])
        seconds = CounterMetricFamily(PREFIX + "engine_step_seconds", "Engine step time, by phase and part "
                                      "(target forward, draft proposal, sampling and verification, other).",
                                      labels=[*self.labels, "phase", "part"])
        for phase, t in phases.items():
            steps.add_metric([*self.labels.values(), phase], t["num_steps"])
            rows.add_metric([*self.labels.values(), phase], t["num_tokens"])
            for part, value in t["seconds"].items():
                seconds.add_metric([*self.labels.values(), phase, part], value)
        yield from (steps, rows, seconds)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot, model_name))
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self._success = counter("request_success", "Finished prompts (engine requests), by finish reason.",
                                ["finished_reason"])
        self._aborted = counter("request_aborted", "Prompts aborted (client gone, shutdown).").labels(model_name)
        self._failed = counter("request_failed", "Prompts failed by an engine step that raised.").labels(model_name)
        self._rejected = counter("request_rejected", "Requests answered with an error, by HTTP status (499: the "
                                 "client closed its connection before its body arrived).", ["status"])
        self._refused = counter("connections_refused", "Connections turned away at --max-connections.").labels(
            model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between token deliveries divided by the tokens delivered (one sample per token).",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.model_name = model_name

    def request_finished(self, reason: str) -> None:
        """``reason``: a finish reason ("stop", "length"), "abort" or "failed"."""
        if reason == "abort":
            self._aborted.inc()
        elif reason == "failed":
            self._failed.inc()
        else:
            self._success.labels(self.model_name, reason).inc()

    def request_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def connection_refused(self) -> None:
        self._refused.inc()

    def observe_tokens(self, num_new: int, gap: float | None) -> None:
        """``num_new`` tokens arrived ``gap`` seconds after the previous delivery (None: first)."""
        self.generation_tokens.inc(num_new)
        if gap is not None and num_new > 0:
            per_token = gap / num_new
            for _ in range(num_new):
                self.itl.observe(per_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_spec_counters(text: str) -> dict:
    """From /metrics text: ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens`` (summed
    over models) and ``per_pos`` (accepted tokens by draft position)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": []}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(PREFIX + "spec_decode_").removesuffix("_total")
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if name == "num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif name in out:
                out[name] += sample.value
    out["per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)]
    return out
