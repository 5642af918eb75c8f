"""/metrics' engine gauges from the snapshot ``EngineCore.get_metrics`` publishes: the KV cache as
vLLM reports it (``kv_cache_usage_perc``) and each KV cache group's blocks, labelled by group."""
from prometheus_client.parser import text_string_to_metric_families

from specdec.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_kv_gauges_report_every_group():
    snapshot = {"kv_cache_usage": 0.25, "num_kv_blocks": 300, "num_free_kv_blocks": 240,
                "kv_cache_groups": {"full_attention": {"num_blocks": 100, "num_free_blocks": 60, "usage": 0.4},
                                    "sliding_window_512": {"num_blocks": 200, "num_free_blocks": 180, "usage": 0.1}}}
    got = samples(ServerMetrics("m", lambda: snapshot))
    assert got[("specdec:kv_cache_usage_perc", ())] == 0.25
    assert got[("specdec:kv_cache_total_blocks", ())] == 300 and got[("specdec:kv_cache_free_blocks", ())] == 240
    expected = {"full_attention": (100, 60, 0.4), "sliding_window_512": (200, 180, 0.1)}
    for group, (total, free, usage) in expected.items():
        labels = (("kv_cache_group", group),)
        assert got[("specdec:kv_cache_group_total_blocks", labels)] == total
        assert got[("specdec:kv_cache_group_free_blocks", labels)] == free
        assert got[("specdec:kv_cache_group_usage_perc", labels)] == usage
    # an engine that reports no groups (or an empty snapshot before the first step) emits none
    assert not any(name.startswith("specdec:kv_cache_group_") for name, _ in samples(ServerMetrics("m", dict)))


def test_engine_step_timings_by_phase_and_part():
    seconds = {"target": 0.5, "draft": 0.25, "sampling": 0.125, "other": 0.0625}
    snapshot = {"step_timings": {"prefill": {"num_steps": 2, "num_tokens": 300, "seconds": seconds},
                                 "decode": {"num_steps": 40, "num_tokens": 280, "seconds": {**seconds, "target": 3.0}}}}
    got = samples(ServerMetrics("m", lambda: snapshot))
    assert got[("specdec:engine_steps_total", (("phase", "prefill"),))] == 2
    assert got[("specdec:engine_steps_total", (("phase", "decode"),))] == 40
    assert got[("specdec:engine_step_tokens_total", (("phase", "prefill"),))] == 300
    assert got[("specdec:engine_step_seconds_total", (("part", "draft"), ("phase", "prefill")))] == 0.25
    assert got[("specdec:engine_step_seconds_total", (("part", "target"), ("phase", "decode")))] == 3.0
    assert not any(name.startswith("specdec:engine_step") for name, _ in samples(ServerMetrics("m", dict)))
