"""Assemble an engine's parts from an EngineConfig: device, models, KV cache, scheduler, proposer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.config import EngineConfig
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.scheduler import Scheduler
from specdec.layers.quantization import prepare_for_inference
from specdec.models.loader import load_config, load_model, resolve_model_path
from specdec.runtime.device import apply_platform_defaults, resolve_device, resolve_dtype
from specdec.runtime.model_runner import ModelRunner
from specdec.spec.controller import SpecController
from specdec.spec.metrics import SpecDecodeMetrics

DEFAULT_CPU_KV_BYTES = 2 << 30
MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    model_path: str
    model_config: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    proposer: Any
    spec_controller: SpecController | None
    spec_metrics: SpecDecodeMetrics
    output: OutputProcessor
    rejection_sampler: Any
    generation_defaults: dict
    draft_runner: ModelRunner | None = None


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is one clear error
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None


_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(path: str) -> dict:
    """Sampling defaults the checkpoint's generation_config.json sets explicitly (vLLM's
    generation_config="auto"): used when a caller passes no SamplingParams."""
    import json
    from pathlib import Path

    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    if raw.get("do_sample") is False:
        raw["temperature"] = 0.0
    return {ours: raw[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if raw.get(theirs) is not None}


def eos_ids(path: str, tokenizer, config) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(path)
        e = gen.eos_token_id
        ids.extend(e if isinstance(e, list) else [e] if e is not None else [])
    except (OSError, ValueError):
        pass
    e = getattr(config, "eos_token_id", None)
    ids.extend(e if isinstance(e, list) else [e] if e is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _max_model_len(config, requested: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        limit = min(limit, window)  # no sliding-window attention yet: stay inside the window
    if requested is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} positions")
    return requested


def _num_blocks(cfg: EngineConfig, device, bytes_per_block: int, max_model_len: int, max_k: int) -> int:
    per_seq_blocks = -(-(max_model_len + max_k + 1) // cfg.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1.0 - cfg.gpu_memory_utilization))
    elif cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    else:
        budget = min(DEFAULT_CPU_KV_BYTES, cfg.max_num_seqs * per_seq_blocks * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < per_seq_blocks:
        raise ValueError(
            f"KV cache of {budget} bytes holds {num_blocks} blocks of {cfg.block_size} tokens; one sequence of "
            f"max_model_len={max_model_len} needs {per_seq_blocks}: raise kv_cache_memory or lower max_model_len"
        )
    return num_blocks


def build_engine_parts(cfg: EngineConfig) -> EngineParts:
    device = resolve_device(cfg.device)
    apply_platform_defaults(device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)
    path = resolve_model_path(cfg.model)
    config = load_config(path)
    tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer) if cfg.tokenizer else path)
    max_model_len = _max_model_len(config, cfg.max_model_len)
    attn_backend = _attention_backend(cfg, device)
    model = load_model(path, dtype, device, attn_backend, config)

    spec = cfg.speculative_config
    max_k = spec.num_spec_slots if spec else 0
    bytes_per_block = ModelRunner.kv_bytes_per_block(config, cfg.block_size, dtype)
    draft_model = draft_cfg = draft_dtype = None
    if spec is not None and spec.method == "draft_model":
        draft_path = resolve_model_path(spec.model)
        draft_cfg = load_config(draft_path)
        check_vocab_compatible(tokenizer, config, load_tokenizer(draft_path), draft_cfg, draft_path)
        draft_limit = getattr(draft_cfg, "max_position_embeddings", None) or max_model_len
        if draft_limit < max_model_len:  # drafts stay below max_model_len (the scheduler caps K)
            if cfg.max_model_len is not None:
                raise ValueError(f"max_model_len {max_model_len} exceeds the draft model's limit of "
                                 f"{draft_limit} positions")
            max_model_len = draft_limit
        draft_dtype = dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, device)
        draft_model = prepare_for_inference(
            load_model(draft_path, draft_dtype, device, attn_backend, draft_cfg), spec.quantization, device)
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft_cfg, cfg.block_size, draft_dtype)
    eagle = spec is not None and spec.method == "eagle"
    if eagle:
        from specdec.models.eagle import is_eagle_folder, load_head

        head_path = resolve_model_path(spec.model)
        if not is_eagle_folder(head_path):
            raise ValueError(f"speculative_config.model {spec.model!r} is not an EAGLE head (its config.json has no "
                             f"'specdec_eagle' entry); make one with `specdec train-draft --arch eagle`")
        draft_dtype = dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, device)
        # attached before the target's linears are packed: the head copies rows of its LM head
        draft_model = prepare_for_inference(load_head(head_path, model, draft_dtype, device, attn_backend),
                                            spec.quantization, device)
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft_model.config, cfg.block_size, draft_dtype)
    model = prepare_for_inference(model, cfg.quantization, device)
    num_blocks = _num_blocks(cfg, device, bytes_per_block, max_model_len, max_k)
    runner = ModelRunner(model, num_blocks, cfg.block_size, device, dtype)
    runner.reuse_logits = True  # one target forward per step; its logits are dead by the next
    kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    scheduler = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len, cfg.enable_chunked_prefill)
    draft_runner = ModelRunner(draft_model, num_blocks, cfg.block_size, device, draft_dtype) if draft_model else None
    # EAGLE reads the target's hidden states, which captured graphs do not return: eager there
    if device.type == "cuda" and attn_backend.name == "triton" and not cfg.enforce_eager \
            and not eagle:
        _enable_graphs(cfg, runner, draft_runner, max_model_len, spec)
    vocab_size = config.vocab_size
    proposer = build_proposer(spec, draft_runner, kv, vocab_size) if spec else None
    controller = SpecController.build(spec, proposer, runner, draft_runner, cfg, max_model_len) if spec else None
    return EngineParts(
        device=device, dtype=dtype, tokenizer=tokenizer, model_path=path, model_config=config,
        max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=eos_ids(path, tokenizer, config),
        runner=runner, kv=kv, scheduler=scheduler, proposer=proposer, spec_controller=controller,
        spec_metrics=SpecDecodeMetrics(method=spec.method if spec else "none"),
        output=OutputProcessor(tokenizer, max_model_len), rejection_sampler=_rejection_sampler(device),
        generation_defaults=generation_defaults(path),
        draft_runner=draft_runner,
    )


def _enable_graphs(cfg: EngineConfig, runner, draft_runner, max_model_len: int, spec) -> None:
    """Capture decode (q = 1) and verification (q = K + 1, every K up to the maximum: adaptive K
    varies it) graphs for the target, proposal-pass graphs (q = 1) for a draft model, and for
    token trees the padded tree graphs of both."""
    sizes = sorted({b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs} | {1})
    max_blocks = -(-max_model_len // cfg.block_size) + 1
    max_k = spec.max_k if spec else 0
    runner.enable_graphs(sizes, [1] + [k + 1 for k in range(1, max_k + 1)], max_blocks)
    if draft_runner is not None:
        draft_runner.enable_graphs(sizes, [1], max_blocks)
    if spec is not None and spec.is_tree:  # a tree step: the root row and up to num_tree_nodes nodes
        rows = cfg.max_num_batched_tokens  # no step holds more
        runner.enable_tree_graphs(sizes, 1 + spec.num_tree_nodes, spec.num_tree_nodes, max_blocks, max_rows=rows)
        if draft_runner is not None:  # a tree pass feeds <= tree_topk nodes, each seeing the nodes fed before
            draft_runner.enable_tree_graphs(sizes, spec.tree_topk, spec.tree_topk * spec.max_k, max_blocks,
                                            max_rows=rows)


def _attention_backend(cfg: EngineConfig, device):
    from specdec.layers.attention import REFERENCE_BACKEND, TORCH_BACKEND, AttentionBackend

    if cfg.attention_backend == "reference":
        return REFERENCE_BACKEND
    if cfg.attention_backend == "torch" or (cfg.attention_backend == "auto" and device.type != "cuda"):
        return TORCH_BACKEND
    try:
        from specdec.kernels.kv_cache import write_kv_cache_triton
        from specdec.kernels.paged_attention import paged_attention_triton
    except ImportError as e:
        if cfg.attention_backend == "triton":
            raise ValueError(f"attention_backend='triton' needs triton: {e}") from None
        return TORCH_BACKEND
    return AttentionBackend("triton", write_kv_cache_triton, paged_attention_triton)


def _rejection_sampler(device):
    """The Triton sampler on GPUs (same draws, same results as the reference), torch elsewhere."""
    from specdec.spec.rejection_sampler import rejection_sample

    if device.type != "cuda":
        return rejection_sample
    try:
        from specdec.kernels.rejection_sampler import rejection_sample_triton
    except ImportError:
        return rejection_sample
    return rejection_sample_triton


def check_vocab_compatible(tokenizer, config, draft_tokenizer, draft_config, draft_path: str) -> None:
    """The draft must speak the target's token ids: same vocabulary (padding beyond it is fine)."""
    if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            f"draft model {draft_path!r} has a different tokenizer from the target "
            f"({len(draft_tokenizer)} vs {len(tokenizer)} tokens): its token ids would not mean the same thing"
        )
    if draft_config.vocab_size < len(tokenizer):
        raise ValueError(
            f"draft vocab_size {draft_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )


def _tree_args(spec) -> dict:
    if not spec.is_tree:
        return {}
    return {"tree_topk": spec.tree_topk, "tree_depth": spec.max_k, "tree_nodes": spec.num_tree_nodes}


def build_proposer(spec, draft_runner, kv, vocab_size):
    from specdec.spec.proposer import TokenListProposer

    if spec.method == "draft_model":
        from specdec.spec.draft_model import DraftModelProposer

        return DraftModelProposer(draft_runner, kv, vocab_size, **_tree_args(spec))
    if spec.method == "eagle":
        from specdec.spec.eagle import EagleProposer

        return EagleProposer(draft_runner, kv, vocab_size, **_tree_args(spec))
    if spec.method == "ngram":
        from specdec.spec.ngram import NgramProposer

        return TokenListProposer(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.max_k), "ngram")
    if spec.method == "suffix":
        from specdec.spec.suffix import SuffixProposer

        return TokenListProposer(SuffixProposer(spec.max_k), "suffix")
    if spec.method == "replay":
        from specdec.spec.replay import ReplayProposer

        return ReplayProposer(spec.acceptance, vocab_size)
    raise ValueError(f"unknown speculative method {spec.method!r}")
