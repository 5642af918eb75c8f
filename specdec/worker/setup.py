"""Build a worker's device state from an EngineConfig: models, runners and their paged KV
caches, graphs, the proposer and the verifiers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.layers.quantization import prepare_for_inference
from specdec.models.gguf_quant import has_quantized_linears
from specdec.models.loader import load_config, load_model, resolve_model_path
from specdec.spec_decode.verifier import ChainVerifier, TreeVerifier
from specdec.worker import device as device_info
from specdec.worker.device import (apply_platform_defaults, kv_cache_bytes_from_gpu_utilization, resolve_device,
                                   resolve_dtype)
from specdec.worker.model_runner import ModelRunner

DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class WorkerParts:
    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner
    draft_runner: ModelRunner | None
    proposer: object | None
    chain_verifier: ChainVerifier
    tree_verifier: TreeVerifier


def blocks_per_sequence(cfg: EngineConfig, max_model_len: int, max_k: int) -> int:
    """KV blocks one max_model_len sequence needs (its K speculative slots and the bonus token included)."""
    return -(-(max_model_len + max_k + 1) // cfg.block_size)


def num_kv_blocks(cfg: EngineConfig, device, bytes_per_block: int, max_model_len: int, max_k: int) -> int:
    """KV blocks for this engine: ``kv_cache_memory`` bytes when set (any device); on a GPU otherwise
    what ``gpu_memory_utilization`` of the device leaves after what this process already holds
    (weights, other engines), never more than is free (memory the caching allocator holds for no
    tensor counts as free); on CPU otherwise 2 GiB or what max_num_seqs sequences need."""
    per_seq_blocks = blocks_per_sequence(cfg, max_model_len, max_k)
    if cfg.kv_cache_memory is not None:
        budget, setting = cfg.kv_cache_memory, "raise kv_cache_memory"
    elif device.type == "cuda":
        held = torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - held
        budget = kv_cache_bytes_from_gpu_utilization(cfg.gpu_memory_utilization, held, device, free_bytes=free)
        setting = f"raise gpu_memory_utilization (now {cfg.gpu_memory_utilization}), set kv_cache_memory"
    else:
        budget = min(DEFAULT_CPU_KV_BYTES, cfg.max_num_seqs * per_seq_blocks * bytes_per_block)
        setting = "raise kv_cache_memory"
    num_blocks = budget // bytes_per_block
    if num_blocks < per_seq_blocks:
        raise ValueError(
            f"KV cache of {budget} bytes holds {num_blocks} blocks of {cfg.block_size} tokens; one sequence of "
            f"max_model_len={max_model_len} needs {per_seq_blocks}: {setting} or lower max_model_len"
        )
    return num_blocks


def build_worker_parts(cfg: EngineConfig, model_path: str, model_config, vocab_size: int, max_model_len: int,
                       shared_model=None, tp=None) -> WorkerParts:
    """``shared_model``: use these target weights instead of loading a copy (benchmarks that
    compare proposers over one set of weights). ``tp``: this rank's ``TensorParallelGroup``."""
    device = tp.device if tp is not None else resolve_device(cfg.device)
    apply_platform_defaults(device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    spec = cfg.speculative_config
    max_k = spec.num_spec_slots if spec else 0
    widened = _bf16_weights_float32_activations(cfg, device, model_path, tp) and _kv_fits(
        cfg, ModelRunner.kv_bytes_per_block(model_config, cfg.block_size, torch.float32), max_model_len, max_k)
    dtype = torch.float32 if widened else _compute_dtype(cfg, device)
    attn_backend = _attention_backend(cfg, device, dtype)
    model = shared_model if shared_model is not None else load_model(
        model_path, torch.bfloat16 if widened else dtype, device, attn_backend, model_config, tp=tp)
    bytes_per_block = ModelRunner.kv_bytes_per_block(model_config, cfg.block_size, dtype)
    draft_model = draft_dtype = draft_vocab = None
    if spec is not None and spec.method == "draft_model":
        draft_path = resolve_model_path(spec.model)
        draft_cfg = load_config(draft_path)
        draft_dtype = dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, device)
        draft_tp = tp if spec.draft_tensor_parallel_size > 1 else None
        # a bf16-weights / float32-activations target gets a draft of the same kind (spec.dtype "auto")
        draft_widened = (widened and spec.dtype == "auto" and spec.quantization is None
                         and not has_quantized_linears(draft_path))
        draft_model = load_model(draft_path, torch.bfloat16 if draft_widened else draft_dtype, device, attn_backend,
                                 draft_cfg, tp=draft_tp)
        if spec.draft_vocab_size is not None or spec.draft_vocab is not None:
            draft_vocab = _restrict_draft_vocab(spec, draft_model, draft_path, min(draft_cfg.vocab_size, vocab_size))
        draft_model = prepare_for_inference(draft_model, spec.quantization, device, _bf16_weights(
            cfg.dtype if spec.dtype == "auto" else spec.dtype, draft_dtype, device))
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft_cfg, cfg.block_size, draft_dtype)
    eagle = spec is not None and spec.method in ("eagle", "eagle3")
    aux_layers: tuple[int, ...] = ()
    if eagle:
        draft_dtype = dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, device)
        # attached before the target's linears are packed: an EAGLE head copies rows of its LM head
        draft_model = prepare_for_inference(_load_head(spec, model, draft_dtype, device, attn_backend),
                                            spec.quantization, device)
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft_model.config, cfg.block_size, draft_dtype)
        if spec.method == "eagle3":  # the target exports these layers' inputs for the head
            aux_layers = draft_model.options.aux_layer_ids
    if shared_model is None:
        model = prepare_for_inference(model, cfg.quantization, device, _bf16_weights(cfg.dtype, dtype, device))
    num_blocks = num_kv_blocks(cfg, device, bytes_per_block, max_model_len, max_k)
    if tp is not None:  # one block pool serves every rank: the smallest cache decides
        num_blocks = tp.min_int(num_blocks)
    runner = ModelRunner(model, num_blocks, cfg.block_size, device, dtype, reuse_logits=True, aux_layers=aux_layers)
    draft_runner = ModelRunner(draft_model, num_blocks, cfg.block_size, device, draft_dtype) if draft_model else None
    # EAGLE heads read the target's hidden states, which captured graphs do not return: eager there
    # collectives are not captured in graphs yet: tensor-parallel ranks run eagerly
    # LoRA rows take their adapter from each step's metadata, which a replayed graph does not read: eager
    if device.type == "cuda" and attn_backend.name == "triton" and not cfg.enforce_eager and not eagle and tp is None \
            and not cfg.enable_lora:
        _enable_graphs(cfg, runner, draft_runner, max_model_len, spec)
    proposer = build_proposer(spec, draft_runner, vocab_size, draft_vocab) if spec else None
    return WorkerParts(device, dtype, runner, draft_runner, proposer, ChainVerifier(_rejection_sampler(device)),
                       TreeVerifier())


def _restrict_draft_vocab(spec, draft_model, draft_path: str, vocab_size: int) -> torch.Tensor:
    """The draft's LM head cut to its draft vocabulary (``spec_decode/draft_vocab.py``), chosen among the
    ids the draft and the target share: the kept ids."""
    from specdec.engine.builder import load_tokenizer
    from specdec.spec_decode.draft_vocab import draft_vocabulary, restrict_lm_head

    ids = draft_vocabulary(load_tokenizer(draft_path), vocab_size, spec.draft_vocab_size, spec.draft_vocab)
    restrict_lm_head(draft_model, ids)
    return ids


def _compute_dtype(cfg: EngineConfig, device) -> torch.dtype:
    """``dtype="auto"`` with int8 activations (w8a8 / w4a8) on CPU is float32 even where the CPU
    computes in bf16: their losslessness rests on every op computing a row the same whatever the
    batch, which the row-by-row attention kernel gives in float32 only (and float32 activations
    are what the kernel quantizes anyway)."""
    if cfg.dtype == "auto" and device.type == "cpu" and cfg.quantization in ROW_CONSISTENT_QUANTIZATIONS:
        return torch.float32
    return resolve_dtype(cfg.dtype, device)


def _kv_fits(cfg: EngineConfig, bytes_per_block: int, max_model_len: int, max_k: int) -> bool:
    """Whether the CPU KV budget holds one max_model_len sequence at ``bytes_per_block`` (the target's
    alone: a float32 cache is twice a bf16 one, and an engine that starts as a bf16 model must
    still start)."""
    budget = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES
    return budget // bytes_per_block >= blocks_per_sequence(cfg, max_model_len, max_k)


def _bf16_weights_float32_activations(cfg: EngineConfig, device, model_path: str, tp) -> bool:
    """``dtype="auto"`` on a CPU with bf16 arithmetic, no quantization: the model is
    loaded in bf16, its linears keep their bf16 weights (``Bf16WeightLinear``, the same bytes per
    step as a bf16 model) and everything else computes in float32, which takes the fused float32
    CPU ops and the row-by-row attention kernel. Only where the bf16 kernel is the faster linear
    here (``bf16_kernel_faster``) and (the caller checks) the KV budget holds a max_model_len
    sequence in float32."""
    from specdec.layers.quantization import bf16_kernel_faster

    if cfg.dtype != "auto" or device.type != "cpu" or cfg.quantization is not None or tp is not None:
        return False
    if not device_info.cpu_supports_bf16() or has_quantized_linears(model_path):
        return False
    return bf16_kernel_faster()


def _bf16_weights(requested, dtype: torch.dtype, device) -> str | None:
    """``dtype="auto"`` that became float32 on a CPU without bf16 arithmetic: linears a bf16
    checkpoint filled keep their bf16 weights (the same values, half the bytes per step)."""
    return "exact" if requested == "auto" and dtype == torch.float32 and device.type == "cpu" else None


def _load_head(spec, target, dtype: torch.dtype, device, attn_backend):
    """The EAGLE head (``models/eagle.py``) or speculators EAGLE-3 head (``models/speculators.py``) of
    ``spec.model``, attached to ``target``."""
    from specdec.models.eagle import is_eagle_folder, load_head
    from specdec.models.speculators import is_speculators_folder, load_eagle3

    head_path = resolve_model_path(spec.model)
    if spec.method == "eagle3":
        if not is_speculators_folder(head_path):
            raise ValueError(f"speculative_config.model {spec.model!r} is not a speculators EAGLE-3 checkpoint (its "
                             f"config.json has no 'speculators_model_type'); make one with `specdec train-draft "
                             f"--arch eagle3`")
        return load_eagle3(head_path, target, dtype, device, attn_backend)
    if not is_eagle_folder(head_path):
        hint = " (it is a speculators checkpoint: use method 'eagle3')" if is_speculators_folder(head_path) else ""
        raise ValueError(f"speculative_config.model {spec.model!r} is not an EAGLE head (its config.json has no "
                         f"'specdec_eagle' entry){hint}; make one with `specdec train-draft --arch eagle`")
    return load_head(head_path, target, dtype, device, attn_backend)


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


# int8 activations round a layer's input: they need every other op to compute a token's row the
# same in a decode step and in a verification (specdec.kernels.attention_rows)
ROW_CONSISTENT_QUANTIZATIONS = ("w8a8", "w4a8")


def _attention_backend(cfg: EngineConfig, device, dtype: torch.dtype = torch.float32):
    """``"auto"``: on CPU the row-by-row C++ attention for float32 (faster than the batched torch
    path at decode and verification, and the one int8 activations need), the torch path
    otherwise; Triton on CUDA."""
    from specdec.layers.attention import (
        REFERENCE_BACKEND,
        TORCH_BACKEND,
        AttentionBackend,
    )

    if cfg.attention_backend == "reference":
        return REFERENCE_BACKEND
    if cfg.attention_backend == "rows" or (cfg.attention_backend == "auto" and device.type == "cpu" and (
            cfg.quantization in ROW_CONSISTENT_QUANTIZATIONS or (dtype == torch.float32 and _rows_kernel()))):
        from specdec.kernels.attention_rows import ROWS_BACKEND

        return ROWS_BACKEND
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


def _rows_kernel() -> bool:
    """Whether the rows kernel can run here, asked without its warnings for the cases "auto" skips."""
    from specdec.kernels import cpp_build, woq_cpu
    from specdec.kernels.attention_rows import extension

    if cpp_build.disabled(woq_cpu.DISABLE_ENV) or not woq_cpu.cpu_isas():
        return False
    return extension() is not None


def _rejection_sampler(device):
    """The Triton sampler on GPUs (same draws, same results as the reference), torch elsewhere."""
    from specdec.spec_decode.rejection_sampler import rejection_sample

    if device.type != "cuda":
        return rejection_sample
    try:
        from specdec.kernels.rejection_sampler import rejection_sample_triton
    except ImportError:
        return rejection_sample
    return rejection_sample_triton


def _tree_args(spec) -> dict:
    if not spec.is_tree:
        return {}
    return {"tree_topk": spec.tree_topk, "tree_depth": spec.max_k, "tree_nodes": spec.num_tree_nodes}


def build_proposer(spec, draft_runner, vocab_size, draft_vocab=None):
    from specdec.spec_decode.proposer import TokenListProposer

    if spec.method == "draft_model":
        from specdec.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(draft_runner, vocab_size, **_tree_args(spec), draft_vocab=draft_vocab)
    if spec.method == "eagle":
        from specdec.spec_decode.eagle import EagleProposer

        return EagleProposer(draft_runner, vocab_size, **_tree_args(spec))
    if spec.method == "eagle3":
        from specdec.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(draft_runner, vocab_size, **_tree_args(spec))
    if spec.method == "ngram":
        from specdec.spec_decode.ngram import NgramProposer

        return TokenListProposer(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.max_k), "ngram")
    if spec.method == "suffix":
        from specdec.spec_decode.suffix import SuffixProposer

        return TokenListProposer(SuffixProposer(spec.max_k), "suffix")
    if spec.method == "replay":
        from specdec.bench.replay import ReplayProposer

        return ReplayProposer(spec.acceptance, vocab_size)
    raise ValueError(f"unknown speculative method {spec.method!r}")
