""""auto" speculation on a mixture-of-experts target: replay proposer at a set acceptance, "auto"
against plain decoding and every fixed K, at batch 1 and batch 8, on one process sharing the
target's weights (engines rotated per round).

    # a random MoE with Qwen3-30B-A3B's per-layer shapes (hidden 2048, 128 experts of 768, top-8)
    python scripts/moe_auto.py make /tmp/moe_a3b --num-layers 4
    # plain vs "auto" vs K=1..7 at acceptance 0.8 and 0.3, batch 1 and 8, int8 experts
    python scripts/moe_auto.py run /tmp/moe_a3b --quantization int8 --acceptances 0.8 0.3 --batch-sizes 1 8

``run`` takes any model path the engine loads (a safetensors folder or a GGUF file). It prints,
per (acceptance, batch): decode tokens/s of each engine and its ratio to plain, the K "auto"
chose (mean drafted tokens per step), and the cost model's v(K) = step(B (K+1) rows) / step(B rows)
next to the measured one, with the experts the rows read per layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

A3B_SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def make_model(out_dir: str, num_layers: int = 4, vocab_size: int = 32000, seed: int = 0,
               layer_scale: float = 0.01, router_std: float = 2.0) -> Path:
    """A random Qwen3-MoE checkpoint (bf16) with Qwen3-30B-A3B's per-layer shapes. Greedy decoding
    is made robust across batch shapes the way ``bench.models.make_random_llama`` does it (the
    embedding dominates the residual stream, the lm_head is a row permutation of it), so a replay
    reference survives verification. Router logits have standard deviation ~``router_std`` on
    every token: rows route to varied experts, as trained routers do."""
    import transformers

    from specdec.models.tiny import make_tokenizer

    tokenizer = make_tokenizer(320)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, num_hidden_layers=num_layers, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **A3B_SHAPE)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj")) or name.endswith("down_proj.weight"):
                param.mul_(layer_scale)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, router_std / config.hidden_size ** 0.5)
        model.lm_head.weight.copy_(embed[torch.randperm(embed.shape[0])])
    model.config.dtype = "bfloat16"
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def measured_verification_costs(llm, batch_sizes, max_k: int, context: int) -> dict:
    """v(K) = step(B (K+1) rows) / step(B rows), timed on the target before it serves anything, with
    the experts read per layer (the union over the step's rows, averaged over layers)."""
    from specdec.layers.moe import moe_layers
    from specdec.worker.calibrate import time_verify_forward

    runner = llm.engine.executor.driver_worker.runner
    layers = moe_layers(runner.model)
    table = {}
    for batch in batch_sizes:
        seconds, experts = [], []
        for k in range(max_k + 1):
            for layer in layers:
                layer.stats.reset()
                layer.stats.recording = True
            seconds.append(time_verify_forward(runner, batch, k + 1, context, repeats=3))
            experts.append(statistics.mean(min(layer.stats.history) for layer in layers) if layers else 0.0)
            for layer in layers:
                layer.stats.recording = False
        table[batch] = {"step_s": seconds, "v": [s / seconds[0] for s in seconds], "experts_per_layer": experts}
    return table


def run(args) -> dict:
    from specdec import LLM
    from specdec.bench import driver
    from specdec.spec_decode.controller import SpecController
    from specdec.worker.shared_weights import SharedWeights

    weights = SharedWeights()
    common = dict(quantization=args.quantization, dtype=args.dtype, num_threads=args.num_threads,
                  max_model_len=args.input_len + args.output_len + 64, kv_cache_memory=args.kv_cache_mib << 20,
                  max_num_seqs=max(args.batch_sizes))
    plain = LLM(model=args.model, target_weights=weights, **common)
    print(f"loaded {args.model} ({args.quantization}); timing v(K)", file=sys.stderr, flush=True)
    costs = measured_verification_costs(plain, args.batch_sizes, args.max_k, args.input_len)
    params = driver.greedy_params(args.output_len)
    prompts = driver.make_prompts(plain, "text", max(args.batch_sizes), args.input_len, seed=args.seed)
    driver.warmup(plain)
    references = driver.timed_generate(plain, prompts, params).token_ids
    results = {"model": args.model, "quantization": args.quantization, "verification_cost": costs, "runs": []}
    for acceptance in args.acceptances:
        spec = {"method": "replay", "num_speculative_tokens": "auto", "max_num_speculative_tokens": args.max_k,
                "acceptance": acceptance}
        auto = LLM(model=args.model, target_weights=weights, speculative_config=spec, **common)
        driver.register_references(auto, prompts, references)
        # warm up on a prompt the proposer holds a reference for: one it cannot draft for would
        # show "auto" no acceptance at all, not the one the timed runs see
        driver.timed_generate(auto, prompts[:1], driver.greedy_params(16))
        controller = auto.engine.spec_controller
        for batch in args.batch_sizes:
            batch_prompts = prompts[:batch]
            policies = ["plain", "auto"] + (args.ks or list(range(1, args.max_k + 1)))
            rates = {p: [] for p in policies}
            drafted = {p: [] for p in policies}
            for round_index in range(args.rounds + 1):  # round 0 warms every policy up, untimed
                shift = round_index % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    llm = plain if policy == "plain" else auto
                    if isinstance(policy, int):
                        auto.engine.set_speculation_policy(SpecController.fixed(policy))
                    try:
                        out = driver.timed_generate(llm, batch_prompts, params)
                    finally:
                        if isinstance(policy, int):
                            auto.engine.set_speculation_policy(controller)
                    if llm is auto and out.token_ids != references[:batch]:
                        raise RuntimeError(f"{policy}: the speculative output differs from plain decoding")
                    if round_index:
                        rates[policy].append(out.decode_tokens_per_s)
                        drafted[policy].append(out.acceptance.num_draft_tokens / max(out.num_decode_steps * batch, 1))
            model_v = [controller.cost.cost("target", batch * (k + 1)) / controller.cost.cost("target", batch)
                       for k in range(args.max_k + 1)]
            median = {p: statistics.median(r) for p, r in rates.items()}
            results["runs"].append({
                "acceptance": acceptance, "batch": batch, "tokens_per_s": {str(p): median[p] for p in policies},
                "over_plain": {str(p): median[p] / median["plain"] for p in policies},
                "auto_drafts_per_step": statistics.median(drafted["auto"]), "cost_model_v": model_v})
            print(render_run(results["runs"][-1], costs[batch]), flush=True)
        del auto
    return results


def render_run(run: dict, measured: dict) -> str:
    lines = [f"acceptance {run['acceptance']}, batch {run['batch']}: decode tok/s (x plain); "
             f"auto drafted {run['auto_drafts_per_step']:.2f} tokens per request-step"]
    lines.append("  " + "  ".join(f"{p}: {r:.2f} ({run['over_plain'][p]:.3f}x)" for p, r in run["tokens_per_s"].items()))
    lines.append("  v(K) measured: " + " ".join(f"{v:.2f}" for v in measured["v"]))
    lines.append("  v(K) cost model: " + " ".join(f"{v:.2f}" for v in run["cost_model_v"]))
    lines.append("  experts/layer: " + " ".join(f"{e:.0f}" for e in measured["experts_per_layer"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="write the random Qwen3-30B-A3B-shaped MoE")
    m.add_argument("out")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--vocab-size", type=int, default=32000)
    r = sub.add_parser("run", help='plain vs "auto" vs fixed K with the replay proposer')
    r.add_argument("model", help="a safetensors folder or a GGUF file")
    r.add_argument("--quantization", default="int8", help='"int8", "w4a8", ... ("none": the checkpoint\'s dtype)')
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--acceptances", type=float, nargs="+", default=[0.8, 0.3])
    r.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    r.add_argument("--max-k", type=int, default=7)
    r.add_argument("--ks", type=int, nargs="*", default=None, help="fixed K to compare (default 1 .. --max-k)")
    r.add_argument("--input-len", type=int, default=64)
    r.add_argument("--output-len", type=int, default=64)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--num-threads", type=int, default=2)
    r.add_argument("--kv-cache-mib", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.command == "make":
        print(make_model(args.out, args.num_layers, args.vocab_size))
        return 0
    if args.quantization == "none":
        args.quantization = None
    results = run(args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
