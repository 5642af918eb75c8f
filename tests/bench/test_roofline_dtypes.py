"""``specdec bench roofline``: one model per dtype, alternated, each against its own roofline."""
import json

from specdec.cli import main


def test_each_dtype_gets_its_decode_rate_and_roofline_fraction(llama_path, tmp_path, capsys, monkeypatch):
    from specdec.bench import report

    monkeypatch.setattr(report, "cpu_kernels", lambda: {"attention": "rows kernel"})  # the header, not measured here
    out = tmp_path / "r.json"
    assert main(["bench", "roofline", "--model", llama_path, "--dtypes", "float32", "bfloat16", "--input-len", "8",
                 "--output-len", "6", "--num-iters", "2", "--bandwidth-mib", "8", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["kind"] == "roofline" and [e["dtype"] for e in r["engines"]] == ["float32", "bfloat16"]
    f32, bf16 = r["engines"]
    # activations: bf16, or float32 where the bf16-weight kernel is faster (dtype="bfloat16" takes auto's path)
    assert f32["engine_dtype"] == "float32" and bf16["engine_dtype"] in ("bfloat16", "float32")
    for e in r["engines"]:
        assert len(e["decode_tokens_per_s_per_iter"]) == 2 and e["roofline_fraction"] > 0
    # bf16 weights stream half the bytes of float32 ones (the embedding gathered, not streamed)
    assert bf16["roofline"]["weight_bytes_per_step"] < 0.6 * f32["roofline"]["weight_bytes_per_step"]
    text = capsys.readouterr().out
    assert text.startswith("CPU: ") and "roofline frac" in text
