"""Per-step engine overhead outside the forward passes, on tiny models (the forward costs little).

For plain decoding and the draft_model / eagle / ngram proposers at batch 1 and 32, greedy,
this runs ``LLM.generate`` (after a warm-up) and reads every decode step's ``StepRecord``: the
whole step, the target forward (with its input preparation), the proposal (draft forwards
included) and the verification, as means over the steps (the slowest tenth dropped).
``outside`` = step - target - draft: planning, scheduling, verification, commit, bookkeeping. Run the same script on two checkouts to compare them:

    PYTHONPATH=/path/to/checkout OMP_NUM_THREADS=1 python scripts/step_overhead.py --out a.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

PROMPTS = ["def f(x):", "import json", "class Decoder(object):", "    return value", "for i in range(10):",
           "if not isinstance(obj, dict):", "Hello", "x = [1, 2, 3]", "while True:\n    pass", "raise ValueError(msg)",
           "try:\n    import json\nexcept ImportError:", "lines = text.splitlines()", "print('hello world')",
           "return self.encode(o)", "chunks = self._split(text)", "s = json.dumps(obj, indent=4)"]


def build(root: Path) -> dict[str, str]:
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model
    from specdec.models.tiny import make_tiny_model, make_tokenizer

    tok = make_tokenizer()
    target = make_tiny_model(root / "target", arch="llama", tokenizer=tok)
    draft = make_tiny_model(root / "draft", arch="llama", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, seed=7, tokenizer=tok)
    head = init_head(load_model(str(target), torch.float32, torch.device("cpu")), seed=1)
    save_head(head, root / "head")
    return {"target": str(target), "draft": str(draft), "head": str(root / "head")}


def measure(paths: dict[str, str], method: str, batch: int, max_tokens: int) -> dict[str, float]:
    from specdec import LLM, SamplingParams

    spec = {"none": None,
            "draft_model": {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "model": paths["head"], "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1}}[method]
    # the torch attention path: no C++ extension to build, and the comparison is about what runs outside it
    llm = LLM(model=paths["target"], dtype="float32", device="cpu", seed=0, max_model_len=512, max_num_seqs=batch,
              attention_backend="torch", speculative_config=spec)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    records = []
    llm.engine.add_step_observer(records.append)
    llm.generate(prompts, params, use_tqdm=False)
    decode = [r for r in records if all(n == 1 for n in r.scheduled.num_scheduled_tokens)]  # no prefill chunks
    # the slowest tenth of the steps dropped (shared cores: other processes' bursts), the same steps
    # for every column, so the means add up: step = target + draft + outside
    kept = sorted(decode, key=lambda r: r.step_seconds)[:max(1, len(decode) * 9 // 10)]

    def mean_us(values):
        return 1e6 * statistics.fmean(values)

    return {
        "steps": len(kept),
        "tokens_per_step": sum(r.total_emitted_tokens for r in kept) / len(kept),
        "step_us": mean_us([r.step_seconds for r in kept]),
        "target_us": mean_us([r.result.target_seconds for r in kept]),
        "draft_us": mean_us([r.result.draft_seconds for r in kept]),
        "verify_us": mean_us([r.result.sampling_seconds for r in kept]),
        "outside_us": mean_us([r.step_seconds - r.result.target_seconds - r.result.draft_seconds for r in kept]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,draft_model,eagle,ngram")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        for method in args.methods.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"method": method, "batch": batch, **measure(paths, method, batch, args.max_tokens)}
                rows.append(row)
                print(f"{method:12s} batch {batch:3d}: " + "  ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                    if k not in ("method", "batch")), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
