"""Assemble a worker's device state from its ``RuntimePlan``: the target (loaded, or handed over
by a ``SharedWeights``), the speculative method's parts, runners and their paged KV caches,
graphs, the proposer and the verifiers. Every choice is the plan's (``worker/plan.py``); every
method-specific part is its registry entry's (``spec_decode/methods.py``)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.engine.kv_layout import KVGroup, KVLayout, with_draft_layers
from specdec.layers.quantization import prepare_for_inference
from specdec.models.loader import load_model, safetensors_files
from specdec.models.memory_check import check_fits_in_memory
from specdec.spec_decode.methods import DraftLoad, DraftParts, SpecMethod, method_of
from specdec.spec_decode.verifier import ChainVerifier, TreeVerifier
from specdec.worker.device import apply_platform_defaults, resolve_device
from specdec.worker.model_runner import ModelRunner
from specdec.worker.kv_budget import blocks_per_sequence, kv_layout
from specdec.worker.plan import Machine, RuntimePlan, resolve_plan
from specdec.worker.shared_weights import SharedWeights

logger = logging.getLogger("specdec")


@dataclass
class WorkerParts:
    plan: RuntimePlan
    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner
    draft_runner: ModelRunner | None
    method: SpecMethod | None
    proposer: object | None
    chain_verifier: ChainVerifier
    tree_verifier: TreeVerifier


def build_worker_parts(cfg: EngineConfig, model_path: str, model_config, vocab_size: int, max_model_len: int,
                       target_weights: SharedWeights | None = None, tp=None,
                       kv_groups: tuple[KVGroup, ...] = ()) -> WorkerParts:
    """``target_weights``: take the target from it when it holds weights loaded for the same plan,
    else load them and leave them there. ``tp``: this rank's ``TensorParallelGroup``. ``kv_groups``:
    the target's layers by window (``engine/kv_layout.py``; () for one group of full attention)."""
    device = tp.device if tp is not None else resolve_device(cfg.device)
    apply_platform_defaults(device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    plan = resolve_plan(cfg, model_path, model_config, max_model_len, Machine(device), tensor_parallel=tp is not None)
    spec = cfg.speculative_config
    method = method_of(spec)
    attn_backend = attention_backend(plan.attention_backend)
    key = (model_path, str(device), plan.target)
    model = target_weights.take(key) if target_weights is not None else None
    shared = model is not None
    if not shared:
        if device.type == "cpu":  # refused before any weight is read when it cannot fit
            check_fits_in_memory(model_path, safetensors_files(model_path), plan.target.load_dtype,
                                 _min_kv_bytes(cfg, plan, model_config, kv_groups, max_model_len),
                                 tp.world_size if tp is not None else 1)
        model = load_model(model_path, plan.target.load_dtype, device, attn_backend, model_config, tp=tp)
    draft = DraftParts()
    if method is not None:
        draft = method.load(DraftLoad(spec, cfg, model, plan.draft, device, attn_backend, vocab_size, tp))
    if not shared:  # after the draft: an EAGLE head copies rows of the target's LM head before packing
        model = prepare_for_inference(model, plan.target.quantization, device, plan.target.bf16_weights)
        if target_weights is not None:
            target_weights.hold(key, model)
    groups = _groups(model_config, kv_groups)
    draft_windows = _draft_layer_windows(method, draft)
    if draft_windows is not None:
        groups = with_draft_layers(groups, draft_windows)
    layout = _kv_layout(cfg, device, plan, model_config, groups, draft.kv_bytes_per_block, max_model_len)
    if tp is not None:  # one block pool per group serves every rank: the smallest cache decides
        layout = dataclasses.replace(layout, groups=tuple(
            dataclasses.replace(g, num_blocks=tp.min_int(g.num_blocks)) for g in layout.groups))
    plan = plan.with_kv_layout(layout, sum(g.bytes_per_block for g in layout.groups))
    num_blocks = layout.groups[0].num_blocks
    if tp is None or tp.is_driver:
        logger.info("%s", plan)
    runner = ModelRunner(model, num_blocks, cfg.block_size, device, plan.dtype, reuse_logits=True,
                         aux_layers=draft.aux_layers, kv_layout=layout)
    # a draft with layers outside the primary group reads those groups' tables too
    grouped_draft = draft_windows is not None and any(g.draft_layers for g in layout.groups[1:])
    draft_runner = ModelRunner(draft.model, num_blocks, cfg.block_size, device, draft.dtype,
                               kv_layout=layout.draft_view() if grouped_draft else None) if draft.model else None
    if plan.graphs:
        _enable_graphs(cfg, runner, draft_runner, max_model_len, spec, method)
    proposer = method.build(spec, draft_runner, vocab_size, draft) if method is not None else None
    return WorkerParts(plan, device, plan.dtype, runner, draft_runner, method, proposer,
                       ChainVerifier(rejection_sampler(plan.sampler)), TreeVerifier())


def _groups(model_config, groups: tuple[KVGroup, ...]) -> tuple[KVGroup, ...]:
    """The target's KV cache groups (one of full attention when the builder gave none)."""
    return groups or (KVGroup(None, tuple(range(model_config.num_hidden_layers))),)


def _draft_layer_windows(method: SpecMethod | None, draft: DraftParts) -> list[int | None] | None:
    """Each draft model layer's sliding window (None: full attention), for a draft whose cache
    reads the target's block tables at the target's positions (same tokenizer, no target features:
    its layers join the groups of their windows); None for every other proposer."""
    if method is None or draft.model is None or not method.draft_kv_cache or method.needs_target_hidden \
            or draft.vocab_bridge is not None:
        return None
    from specdec.models.llama import layer_sliding_window

    config = draft.model.config
    return [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]


def _min_kv_bytes(cfg: EngineConfig, plan: RuntimePlan, model_config, groups: tuple[KVGroup, ...],
                  max_model_len: int) -> int:
    """The target's KV for one max_model_len sequence (a sliding group: its window's blocks)."""
    layer_bytes = ModelRunner.kv_bytes_per_block(model_config, cfg.block_size, plan.dtype) \
        // model_config.num_hidden_layers
    return layer_bytes * sum(blocks_per_sequence(cfg, max_model_len, plan.max_spec_slots, g.window) * len(g.layers)
                             for g in _groups(model_config, groups))


def _kv_layout(cfg: EngineConfig, device, plan: RuntimePlan, model_config, groups: tuple[KVGroup, ...],
               draft_bytes_per_block: int, max_model_len: int) -> KVLayout:
    """The KV pools: per group, its layers' share of the target's cache and its draft layers'
    share of the draft's (a draft whose layers are not grouped: all of it in the primary group)."""
    num_layers = model_config.num_hidden_layers
    layer_bytes = ModelRunner.kv_bytes_per_block(model_config, cfg.block_size, plan.dtype) // num_layers
    num_draft_layers = sum(len(g.draft_layers) for g in groups)
    draft_bytes = [draft_bytes_per_block * len(g.draft_layers) // num_draft_layers if num_draft_layers else
                   (draft_bytes_per_block if i == 0 else 0) for i, g in enumerate(groups)]
    bytes_per_block = [len(g.layers) * layer_bytes + d for g, d in zip(groups, draft_bytes)]
    return kv_layout(cfg, device, groups, bytes_per_block, max_model_len, plan.max_spec_slots)


def attention_backend(name: str):
    """The ``AttentionBackend`` the plan named."""
    from specdec.layers.attention import REFERENCE_BACKEND, TORCH_BACKEND

    if name == "reference":
        return REFERENCE_BACKEND
    if name == "torch":
        return TORCH_BACKEND
    if name == "rows":
        from specdec.layers.attention_rows import ROWS_BACKEND

        return ROWS_BACKEND
    from specdec.layers.attention_triton import TRITON_BACKEND

    return TRITON_BACKEND


def rejection_sampler(name: str):
    """The Triton sampler (same draws, same results as the reference) or the torch one."""
    if name == "triton":
        from specdec.spec_decode.rejection_sampler_triton import rejection_sample_triton

        return rejection_sample_triton
    from specdec.spec_decode.rejection_sampler import rejection_sample

    return rejection_sample


def _enable_graphs(cfg: EngineConfig, runner, draft_runner, max_model_len: int, spec, method) -> None:
    """Capture decode (q = 1) and verification (q = K + 1, every K up to the maximum: adaptive K
    varies it) graphs for the target, proposal-pass graphs (q = 1) for a draft model (an EAGLE
    head's fed its features through a buffer too), and for token trees the padded tree graphs of
    both (a head's tree passes run eagerly: a tree graph feeds no features)."""
    sizes = sorted({b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs} | {1})
    max_blocks = -(-max_model_len // cfg.block_size) + 1
    max_k = spec.max_k if spec else 0
    runner.enable_graphs(sizes, [1] + [k + 1 for k in range(1, max_k + 1)], max_blocks)
    reads_features = method is not None and method.needs_target_hidden
    if draft_runner is not None:
        draft_runner.enable_graphs(sizes, [1], max_blocks,
                                   feature_size=draft_runner.model.config.hidden_size if reads_features else 0)
    if spec is not None and spec.is_tree:  # a tree step: the root row and up to num_tree_nodes nodes
        rows = cfg.max_num_batched_tokens  # no step holds more
        runner.enable_tree_graphs(sizes, 1 + spec.num_tree_nodes, spec.num_tree_nodes, max_blocks, max_rows=rows)
        if draft_runner is not None and not reads_features:  # a tree pass feeds <= tree_topk nodes, each seeing the nodes fed before
            draft_runner.enable_tree_graphs(sizes, spec.tree_topk, spec.tree_topk * spec.max_k, max_blocks,
                                            max_rows=rows)
