"""Build a tiny DeepSeek-V3 target (hidden 512, 8 layers, MLA, 4 routed experts + 1 shared), fit
its LM head to Python sources, distil its MTP layer on its own continuations and save the pair
(``specdec.training.train_mtp``), then optionally benchmark ``"method": "mtp"`` against plain
decoding at batch 1: mean acceptance length and tok/s for K = 1..4.

    python scripts/train_mtp_demo.py /tmp/mtp_demo            # build + train (minutes of CPU)
    python scripts/train_mtp_demo.py /tmp/mtp_demo --bench    # then the K = 1..4 table
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def bench(path: str, ks: list[int], output_len: int, num_iters: int) -> list[dict]:
    """Greedy, batch 1, the bench's code prompts; plain and each K alternated in one process."""
    from specdec import LLM, SamplingParams
    from specdec.bench.driver import CODE_PROMPTS

    engines = {0: LLM(model=path, dtype="float32", device="cpu", max_model_len=512)}
    for k in ks:
        engines[k] = LLM(model=path, dtype="float32", device="cpu", max_model_len=512,
                         speculative_config={"method": "mtp", "num_speculative_tokens": k})
    tokenizer = engines[0].get_tokenizer()
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    times = {k: [] for k in engines}
    outputs = {}
    for k, llm in engines.items():  # warm-up
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = {k: llm.get_metrics() for k, llm in engines.items() if k}
    for _ in range(num_iters):
        for k, llm in engines.items():
            for i, prompt in enumerate(prompts):
                started = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                times[k].append(time.perf_counter() - started)
                outputs.setdefault(k, {})[i] = out[0].outputs[0].token_ids
    rows = []
    plain_s = sum(times[0])
    for k in ks:
        m, b = engines[k].get_metrics(), before[k]
        drafts = m["num_drafts"] - b["num_drafts"]
        accepted = m["num_accepted_tokens"] - b["num_accepted_tokens"]
        per_pos = [a - c for a, c in zip(m["num_accepted_tokens_per_pos"], b["num_accepted_tokens_per_pos"] + [0] * 8)]
        rows.append({"k": k, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                     "acceptance_per_position": [round(a / max(drafts, 1), 3) for a in per_pos],
                     "speedup": plain_s / sum(times[k]), "identical_to_plain": outputs[k] == outputs[0],
                     "tokens_per_s": num_iters * len(prompts) * output_len / sum(times[k]),
                     "plain_tokens_per_s": num_iters * len(prompts) * output_len / plain_s})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--head-steps", type=int, default=300, help="LM-head fitting steps (the target)")
    p.add_argument("--mtp-steps", type=int, default=80, help="MTP distillation steps")
    p.add_argument("--num-sequences", type=int, default=32, help="target continuations to distil on")
    p.add_argument("--unroll", type=int, default=3, help="chained passes trained (drafting positions 1..N)")
    p.add_argument("--residual-scale", type=float, default=0.05, help="the random target blocks' output scale")
    p.add_argument("--bench", action="store_true", help="after training (or on an existing OUT): the K table")
    p.add_argument("--skip-train", action="store_true", help="OUT holds a trained pair already")
    p.add_argument("--ks", default="1,2,3,4")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_train:
        from specdec.training.train_mtp import train_demo

        stats = train_demo(args.out, head_steps=args.head_steps, mtp_steps=args.mtp_steps,
                           num_sequences=args.num_sequences, unroll=args.unroll,
                           residual_scale=args.residual_scale)
        Path(args.out, "train_mtp_stats.json").write_text(json.dumps(stats, indent=1))
    if args.bench:
        rows = bench(args.out, [int(k) for k in args.ks.split(",")], args.output_len, args.num_iters)
        Path(args.out, "bench_mtp.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
