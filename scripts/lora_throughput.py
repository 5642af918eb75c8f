"""Batch throughput with LoRA adapters against the base model, side by side in one process.

    PYTHONPATH=. python scripts/lora_throughput.py [--model SmolLM2-135M-Instruct] [--batch 8]
        [--adapters 4] [--rank 16] [--max-tokens 64] [--rounds 3]

Writes ``--adapters`` random PEFT adapters (every q/k/v/o/gate/up/down module, rank ``--rank``)
for the model, then decodes one batch of ``--batch`` prompts greedily (no speculation) with the
base model and with the adapters spread over the batch (``batch / adapters`` rows each),
alternating the two configurations ``--rounds`` times on one engine. Prints tokens/s of each
round, the median ratio adapted / base, and the extra time per adapted row and step.
The numbers are only as quiet as the machine: on shared cores, compare medians of several rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_adapters(model_path: str, out: Path, count: int, rank: int) -> list[str]:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from specdec.lora.adapter import module_shapes

    cfg = AutoConfig.from_pretrained(model_path)
    shapes = module_shapes(cfg)
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (in_f, out_f) in shapes.items():
                owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
        folder = out / f"adapter{i}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none"}))
        paths.append(str(folder))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args(argv)

    from specdec import LLM, LoRARequest, SamplingParams
    from specdec.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(write_adapters(path, tmp, args.adapters,
                                                                                    args.rank))]
    llm = LLM(model=path, dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              num_threads=args.num_threads, enable_prefix_caching=False)
    prompts = [f"Write a short story about the number {i}." for i in range(args.batch)]
    per_row = [adapters[i % len(adapters)] for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=per_row[:2])  # warm-up

    def run(loras) -> float:
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)

    base, lora = [], []
    for r in range(args.rounds):  # alternate, so a busy spell of the machine hits both
        base.append(run(None))
        lora.append(run(per_row))
        print(f"round {r}: base {base[-1]:.1f} tok/s, {args.adapters} adapters {lora[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(l / b for l, b in zip(lora, base))
    b_med, l_med = statistics.median(base), statistics.median(lora)
    step_base, step_lora = args.batch / b_med, args.batch / l_med  # seconds per decode step (one token per row)
    per_row_ms = (step_lora - step_base) / args.batch * 1e3
    from specdec.layers.lora import LoRALinear

    bf16 = llm.engine.executor.driver_worker.apply_model(
        lambda m: sum(x.bf16 for x in m.modules() if isinstance(x, LoRALinear)))
    print(f"model {args.model}, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on every module, "
          f"dtype {llm.engine.dtype}, adapters in bf16 on {bf16} linears")
    print(f"median tokens/s: base {b_med:.1f}, adapters {l_med:.1f}; ratio {ratio:.3f}; "
          f"extra per adapted row and step {per_row_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
