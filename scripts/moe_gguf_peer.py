"""A random mixture-of-experts model with the per-layer shapes of Qwen3-30B-A3B (hidden 2048, 128
experts of 768, top-8, 32 query / 4 kv heads of 128; 12 layers by default, Qwen2.5's vocabulary),
converted to GGUF Q4_K_M by llama.cpp's own tools, then specdec vs llama.cpp on that file.

    # once (tens of minutes; ~16 GB of bf16 safetensors and a 16 GB bf16 GGUF, both deleted at the
    # end, leave a 4.6 GB Q4_K_M and specdec's converted folder in ~/.cache/specdec/gguf/):
    PYTHONPATH=. nice -n 10 python scripts/moe_gguf_peer.py build
    # the speed goal: specdec plain decode vs llama-bench, alternated; v(K) and experts read:
    PYTHONPATH=. python scripts/moe_gguf_peer.py run --output-json bench_results/moe_gguf_peer.json

Weights: N(0, 0.02) matrices, unit norms; the router rows N(0, 0.3) so that its softmax is peaked
but different rows pick different experts (routing is really exercised, as in a trained model).
``run`` reports, all in one process and alternated ``--rounds`` times: specdec's plain decode
tokens/s (batch 1, ``--threads`` threads, ``--tokens`` new tokens) on the Q4_K_M file and
``llama-bench -m F -p 0 -n TOKENS -t THREADS``; then v(K) = t(K+1 rows) / t(1 row) of one
target forward at a decode position for K = 1..7, on this MoE and on the dense 1.5B GGUF, and the
mean distinct experts per MoE layer read by one row and by K+1 rows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

DEFAULT_DIR = Path.home() / ".cache" / "specdec" / "moe30b"
TOKENIZER_FROM = Path.home() / ".cache" / "specdec" / "models" / "Qwen2.5-Coder-0.5B-Instruct"
DENSE_GGUF = Path.home() / ".cache" / "specdec" / "downloads" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHAPE = dict(hidden_size=2048, num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
             vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
             rope_theta=1e6, max_position_embeddings=4096)
MATRIX_STD, ROUTER_STD = 0.02, 0.3


def llama_cpp_dirs() -> tuple[Path, Path]:
    from specdec.bench.peers.llama_cpp import find_bin_dir, source_dir

    bin_dir, why = find_bin_dir()
    src = source_dir(bin_dir)
    if bin_dir is None or src is None:
        sys.exit(f"llama.cpp not found: {why} (scripts/build_llama_cpp.sh builds it)")
    return bin_dir, src


def write_checkpoint(folder: Path, num_layers: int, seed: int) -> None:
    """config.json, tokenizer, and one bf16 safetensors shard per layer (per-expert HF names),
    written layer by layer so memory stays at one layer (~1.2 GB)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3MoeConfig

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_FROM)
    config = Qwen3MoeConfig(num_hidden_layers=num_layers, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                            **SHAPE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]

    def rand(*shape, std=MATRIX_STD):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        print(f"wrote {name}", flush=True)

    save("model-embed.safetensors", {"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h),
                                     "lm_head.weight": rand(SHAPE["vocab_size"], h),
                                     "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
             p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
             p + "self_attn.q_norm.weight": torch.ones(SHAPE["head_dim"], dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(SHAPE["head_dim"], dtype=torch.bfloat16),
             p + "mlp.gate.weight": rand(e, h, std=ROUTER_STD)}
        for x in range(e):
            t[f"{p}mlp.experts.{x}.gate_proj.weight"] = rand(i, h)
            t[f"{p}mlp.experts.{x}.up_proj.weight"] = rand(i, h)
            t[f"{p}mlp.experts.{x}.down_proj.weight"] = rand(h, i)
        save(f"model-layer{layer:02d}.safetensors", t)
        del t
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def build(args) -> None:
    out = Path(args.dir)
    hf, bf16_gguf, q4 = out / "hf", out / "moe-bf16.gguf", out / "moe-Q4_K_M.gguf"
    bin_dir, src = llama_cpp_dirs()
    free = shutil.disk_usage(out.parent if not out.exists() else out).free
    if not q4.exists() and free < 40e9:
        sys.exit(f"needs ~40 GB free disk in {out} while building, {free / 1e9:.1f} GB free")
    if not (hf / "model.safetensors.index.json").exists() and not q4.exists():
        write_checkpoint(hf, args.layers, args.seed)  # the index is written last
    # each step writes a .part file and renames it when done: a killed build resumes at that step
    if not q4.exists():
        if not bf16_gguf.exists():
            part = bf16_gguf.with_suffix(".gguf.part")
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                            "--outfile", str(part)], check=True)
            part.rename(bf16_gguf)
        part = q4.with_suffix(".gguf.part")
        subprocess.run([str(bin_dir / "llama-quantize"), str(bf16_gguf), str(part), "Q4_K_M", str(args.threads)],
                       check=True)
        part.rename(q4)
        bf16_gguf.unlink()
    if not args.keep_safetensors:
        for f in hf.glob("*.safetensors"):
            f.unlink()
    print(f"{q4}: {q4.stat().st_size / 1e9:.2f} GB")
    from specdec.models.hub import convert_local_gguf

    print(f"specdec's folder (converted once, experts kept in their Q4_K / Q6_K blocks): {convert_local_gguf(q4)}")


def specdec_decode_tps(llm, tokens: int) -> float:
    """Decode tokens/s of one request (batch 1): the first token (prefill) excluded, as llama-bench's
    ``-p 0`` excludes the prompt."""
    from specdec import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [151643, 785, 3974, 13876]}], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)


def llama_bench_tps(bin_dir: Path, gguf: Path, tokens: int, threads: int, log: Path) -> dict:
    from specdec.bench.peers.llama_cpp import run_bench

    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
           "-o", "json"]
    return run_bench(cmd, log)


def verification_costs(llm, max_k: int, context: int) -> dict:
    """v(K) = t(K+1 rows) / t(1 row) of one target forward after ``context`` cached positions (each
    ratio over a one-row time measured right before it, so drifting load cancels), and the mean
    distinct experts per MoE layer those rows read (None for a dense model). Probe rows are distinct
    pseudo-random tokens: an upper bound on the experts real drafts (correlated text) touch."""
    from specdec.layers.moe import moe_layers
    from specdec.worker.calibrate import time_verify_forward

    runner = llm.engine.executor.driver_worker.runner
    layers = moe_layers(runner.model)
    one_row, v, experts = [], {}, {}
    for rows in range(1, max_k + 2):
        if layers:
            for layer in layers:
                layer.stats.reset()
            time_verify_forward(runner, 1, rows, context, repeats=0)
            experts[rows] = statistics.mean(m.stats.last_experts_read for m in layers)
        if rows > 1:
            one_row.append(time_verify_forward(runner, 1, 1, context))
            v[rows - 1] = time_verify_forward(runner, 1, rows, context) / one_row[-1]
    return {"t1_ms": statistics.median(one_row) * 1e3, "v": v, "experts_per_layer": experts or None}


def run(args) -> None:
    from specdec import LLM
    from specdec.bench.report import cpu_header

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    q4 = Path(args.gguf or Path(args.dir) / "moe-Q4_K_M.gguf")
    if not q4.is_file():
        sys.exit(f"{q4} does not exist: run `python scripts/moe_gguf_peer.py build` first")
    bin_dir, _ = llama_cpp_dirs()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    engine = dict(device="cpu", max_model_len=512, spec_cost_calibration=False)
    if args.quantization and args.quantization != "none":
        engine["quantization"] = args.quantization
    t = time.perf_counter()
    llm = LLM(model=str(q4), **engine)
    load_s = time.perf_counter() - t
    specdec_decode_tps(llm, 16)  # warm-up: kernels built and chosen
    rounds = []
    for r in range(args.rounds):  # alternated, so load on the machine hits both engines alike
        ours = specdec_decode_tps(llm, args.tokens)
        peer = llama_bench_tps(bin_dir, q4, args.tokens, args.threads, logs / f"llama_bench_{r}.log")
        rounds.append({"specdec_tps": ours, "llama_cpp_tps": peer["tokens_per_s"],
                       "llama_cpp_samples": peer["samples_tokens_per_s"]})
        print(f"round {r}: specdec {ours:.2f} tok/s, llama.cpp {peer['tokens_per_s']:.2f} tok/s", flush=True)
    moe = verification_costs(llm, args.max_k, args.context)
    del llm
    dense = None
    if DENSE_GGUF.is_file() and not args.skip_dense:
        dense = verification_costs(LLM(model=str(DENSE_GGUF), **engine), args.max_k, args.context)
    print(cpu_header(argparse.Namespace(device="cpu")))
    result = {
        "machine": cpu_header(argparse.Namespace(device="cpu")),
        "gguf": str(q4), "threads": args.threads, "tokens": args.tokens, "quantization": args.quantization,
        "load_s": load_s, "load_average_at_end": os.getloadavg(), "rounds": rounds,
        "specdec_over_llama_cpp": statistics.median(r["specdec_tps"] / r["llama_cpp_tps"] for r in rounds),
        "moe_verification": moe, "dense_1p5b_verification": dense,
    }
    print(json.dumps(result, indent=1, default=str))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="write the random checkpoint, convert and quantize it")
    b.add_argument("--dir", default=str(DEFAULT_DIR))
    b.add_argument("--layers", type=int, default=12)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--keep-safetensors", action="store_true", help="keep the bf16 checkpoint (~16 GB)")
    r = commands.add_parser("run", help="specdec vs llama-bench on the Q4_K_M file; v(K); experts read")
    r.add_argument("--dir", default=str(DEFAULT_DIR))
    r.add_argument("--gguf", default=None, help="default: DIR/moe-Q4_K_M.gguf")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--quantization", default="w4a8",
                   help="w4a8 (int8 activations over the file's weights: specdec's fastest CPU GGUF path) or none")
    r.add_argument("--max-k", type=int, default=7)
    r.add_argument("--context", type=int, default=64, help="cached positions before the timed rows")
    r.add_argument("--skip-dense", action="store_true", help="no v(K) of the dense 1.5B GGUF")
    r.add_argument("--log-dir", default="bench_results/moe_gguf_peer_logs")
    r.add_argument("--output-json", default=None)
    args = parser.parse_args()
    {"build": build, "run": run}[args.command](args)


if __name__ == "__main__":
    main()
