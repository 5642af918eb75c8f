"""``specdec`` command line: generate | chat | serve | bench | models | train-draft | demo."""
from __future__ import annotations

import argparse
import json
import sys

from specdec.config import QUANTIZATION_METHODS
from specdec.spec_decode.methods import method_names


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, default=None,
                   help="model folder, GGUF file or registry name (default: the embedded pair)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (default: 2 GiB on CPU; on a GPU what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU this engine may fill, weights and KV cache together")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--quantization", default=None, choices=list(QUANTIZATION_METHODS),
                   help="target weights: int8 (per channel) or int4 (groups of 128) weight-only; w8a8 / w4a8: "
                        "the same weights with int8 activations (CPU: AVX-512 VNNI or AVX2); int8_dynamic; fp8")
    g.add_argument("--speculative-config", default=None,
                   help=f"JSON, e.g. '{{\"method\": \"ngram\", ...}}'; methods: {', '.join(method_names())}")
    g.add_argument("--speculative-model", default=None)
    g.add_argument("--num-speculative-tokens", default=None)
    g.add_argument("--no-speculation", action="store_true", help="with the default model: turn the draft off")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", help="GPUs: no CUDA/HIP graphs")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the target over N ranks (one process each; torchrun-started ranks too)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) of the model")
    g.add_argument("--max-loras", type=int, default=1, help="distinct adapters one step may run (slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")


def engine_kwargs(args) -> dict:
    kw = dict(
        tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=not args.no_chunked_prefill,
        quantization=args.quantization, num_threads=args.num_threads,
        enforce_eager=getattr(args, "enforce_eager", False),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
    )
    k = args.num_speculative_tokens
    if k is not None and k != "auto":
        k = int(k)
    if args.speculative_config:
        kw["speculative_config"] = args.speculative_config
    elif args.speculative_model:
        kw["speculative_model"] = args.speculative_model
        kw["num_speculative_tokens"] = k
    if args.no_speculation:
        kw["speculative_config"] = None
        kw.pop("speculative_model", None)
    return kw


def make_llm(args, **llm_kwargs):
    """The ``LLM`` the engine flags describe; ``llm_kwargs``: more ``LLM`` arguments (``target_weights``)."""
    from specdec import LLM

    kw = {**engine_kwargs(args), **llm_kwargs}
    if args.model is None and not args.no_speculation:
        from specdec.models.default import default_engine_kwargs

        model, defaults = default_engine_kwargs()
        for key, value in defaults.items():
            kw.setdefault(key, value)
        return LLM(model=model, **kw)
    if args.model is None:
        from specdec.models.default import DEFAULT_TARGET

        return LLM(model=DEFAULT_TARGET, **kw)
    return LLM(model=args.model, **kw)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (mirrors SamplingParams)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def sampling_params(args):
    from specdec import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    if args.chat:
        prompt_ids = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = llm.tokenizer.encode(args.prompt)
    engine = llm.engine
    engine.add_request("cli", prompt_ids, params, prompt=args.prompt)
    printed = [""] * params.n
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
            if params.n == 1:  # stream the single completion as it grows
                text = out.outputs[0].text
                if text.startswith(printed[0]):
                    sys.stdout.write(text[len(printed[0]):])
                    sys.stdout.flush()
                    printed[0] = text
    if params.n == 1:
        sys.stdout.write("\n")
    else:
        for c in final.outputs:
            print(f"--- completion {c.index} ({c.finish_reason}) ---\n{c.text}")
    m = llm.get_metrics()
    stats = final.metrics
    info = {"generated_tokens": stats.num_generated_tokens, "finish_reason": final.outputs[0].finish_reason}
    if m["num_drafts"]:
        info.update(method=m["method"], acceptance_rate=round(m["acceptance_rate"], 3),
                    mean_acceptance_length=round(m["mean_acceptance_length"], 3))
    print(json.dumps(info), file=sys.stderr)
    return 0


def cmd_make_tiny(args) -> int:
    from specdec.models.tiny import make_tiny_model

    path = make_tiny_model(args.out, arch=args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="helpers for trying specdec without downloads")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    t = demo_sub.add_parser("make-tiny", help="write a tiny random checkpoint with a real tokenizer")
    t.add_argument("out")
    t.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    t.add_argument("--num-layers", type=int, default=2)
    t.add_argument("--hidden-size", type=int, default=64)
    t.set_defaults(func=cmd_make_tiny)

    for module in ("specdec.models.hub", "specdec.training.train_draft", "specdec.server.cli", "specdec.bench.cli"):
        _register_optional(module, sub)
    return parser


def _register_optional(module_name: str, sub) -> None:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # the module exists but something it needs is missing: say so
            raise
        return
    module.register_cli(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
