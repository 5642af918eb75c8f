"""The registry of speculative methods: one ``SpecMethod`` entry per method.

An entry describes its method (does it need a draft checkpoint, does drafting cost a model
forward per token, can it draft trees, does it read the target's hidden states, can its steps
run in CUDA/HIP graphs) and does every method-specific part of building an engine: it
validates its part of the ``SpeculativeConfig``, checks its draft against the target before any
weights load, plans its draft's dtype and weight format, loads its parts (``DraftParts``) and
builds its proposer. Nothing outside this file branches on a method's name: config validation,
the CLI, the model-info builder, the runtime plan, the worker and the controller ask the entry.

A new method is a proposer file plus one ``register_method`` call. Methods that are no part of
serving register themselves from their own package (``specdec.bench.replay``: "replay"); ranks
spawned for tensor parallelism import the modules that registered methods
(``registering_modules``) before they read a config.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specdec.config import EngineConfig, SpeculativeConfig
    from specdec.spec_decode.proposer import Proposer
    from specdec.worker.model_runner import ModelRunner
    from specdec.worker.plan import WeightPlan


@dataclass(frozen=True)
class DraftParts:
    """What a method loaded for its proposer (nothing for draft-free methods)."""
    model: nn.Module | None = None  # the draft model or head
    dtype: torch.dtype | None = None  # its activations and KV cache
    kv_bytes_per_block: int = 0  # the bytes its KV cache adds to each block of block_size tokens
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs the target exports for it (EAGLE-3)
    draft_vocab: torch.Tensor | None = None  # [n] target ids its LM head keeps (draft_vocab_size)
    vocab_bridge: Any = None  # a draft with another tokenizer: its ``VocabBridge`` to the target's


@dataclass(frozen=True)
class DraftLoad:
    """What ``SpecMethod.load`` is given: the target as loaded (its linears not yet packed, so a
    head can copy rows of its LM head), the draft's planned weights and the attention backend."""
    spec: SpeculativeConfig
    cfg: EngineConfig
    target: nn.Module
    weights: WeightPlan | None  # the plan's draft weights (``SpecMethod.plan_draft``)
    device: torch.device
    attn_backend: Any
    vocab_size: int
    tp: Any  # this rank's TensorParallelGroup, or None


Control = Callable[["Proposer", Any], Any]


def _no_checks(spec: SpeculativeConfig) -> None:
    return None


def _no_draft_config(spec: SpeculativeConfig, tokenizer, model_config):
    return None


def _no_draft_weights(spec: SpeculativeConfig, cfg: EngineConfig, target: WeightPlan, device) -> WeightPlan | None:
    return None


def _no_parts(load: DraftLoad) -> DraftParts:
    return DraftParts()


def _reset_history(proposer: Proposer, payload: Any) -> None:
    proposer.reset_history()


@dataclass(frozen=True)
class SpecMethod:
    name: str
    build: Callable[[SpeculativeConfig, ModelRunner | None, int, DraftParts], Proposer]
    needs_model: bool = False  # speculative_config.model names its draft model or head
    has_draft_model: bool = False  # drafting costs a model forward per token (the cost model prices it)
    supports_tree: bool = False  # its draft scores candidates: token trees (tree_topk > 1)
    supports_draft_vocab: bool = False  # draft_vocab_size / draft_vocab can cut its LM head
    supports_prompt_lookup: bool = False  # it reads speculative_config.prompt_lookup (``lookup_draft.py``)
    needs_target_hidden: bool = False  # it reads the target's hidden states every step
    graph_capturable: bool = True  # its steps can run in CUDA/HIP graphs
    validate: Callable[[SpeculativeConfig], None] = _no_checks
    draft_kv_cache: bool = False  # its draft keeps a paged KV cache beside the target's (block tables shared)
    own_lm_head: bool = False  # its draft has an LM head of its own (draft_lm_head_quantization sets its format)
    # files only, before any weights load: raises if the draft cannot serve this target; returns the
    # draft model's config (its position limit caps max_model_len, its windows the KV freed) or None
    check_draft: Callable[[SpeculativeConfig, Any, Any], Any] = _no_draft_config
    plan_draft: Callable[[SpeculativeConfig, EngineConfig, WeightPlan, Any], WeightPlan | None] = _no_draft_weights
    load: Callable[[DraftLoad], DraftParts] = _no_parts
    # controls a caller may send its proposer (``Executor.control_proposer``): name -> fn(proposer, payload)
    controls: Mapping[str, Control] = field(default_factory=dict)

    def control(self, proposer: Proposer, name: str, payload: Any = None) -> Any:
        """Run the control ``name`` on this method's ``proposer``; every method has "reset_history"
        (forget what finished requests taught it)."""
        controls = {"reset_history": _reset_history, **self.controls}
        if name not in controls:
            raise ValueError(f"speculative method {self.name!r} has no proposer control {name!r}; "
                             f"it has {sorted(controls)}")
        return controls[name](proposer, payload)


_REGISTRY: dict[str, SpecMethod] = {}
_MODULES: dict[str, str] = {}  # method name -> the module that registered it


def register_method(method: SpecMethod, module: str | None = None) -> SpecMethod:
    """Add ``method`` (registering a name again replaces its entry). ``module``: the module to
    import for the entry to exist in another process (default: the module of ``method.build``)."""
    _REGISTRY[method.name] = method
    _MODULES[method.name] = module or method.build.__module__
    return method


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def registered_methods() -> Mapping[str, SpecMethod]:
    return MappingProxyType(_REGISTRY)


def registering_modules() -> tuple[str, ...]:
    """The modules whose import registers every method registered here."""
    return tuple(sorted(set(_MODULES.values())))


def get_method(name: str) -> SpecMethod:
    method = _REGISTRY.get(name)
    if method is None:
        raise ValueError(f"speculative_config.method must be one of {method_names()}, got {name!r}")
    return method


def method_of(spec: SpeculativeConfig | None) -> SpecMethod | None:
    return None if spec is None else get_method(spec.method)


# ---- the built-in methods ----
def _draft_args(spec: SpeculativeConfig) -> dict:
    """The constructor arguments of a proposer drafted by a model: its tree, or its chain's stopping rule."""
    if not spec.is_tree:
        return {"confidence_threshold": spec.draft_confidence_threshold}
    return {"tree_topk": spec.tree_topk, "tree_depth": spec.max_k, "tree_nodes": spec.num_tree_nodes}


def _draft_dtype(spec: SpeculativeConfig, target: WeightPlan, device):
    from specdec.worker.device import resolve_dtype

    return target.compute_dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, device)


def draft_lm_head_quantization(spec: SpeculativeConfig, quantization: str | None) -> str | None:
    """The weight format of a draft's own LM head when the draft's linears are ``quantization``:
    ``spec.draft_lm_head_quantization``, else the draft's own format (int4 for "int4" / "w4a8", int8
    for "int8" / "w8a8"; None for the others: their head is as the body). A draft never changes the
    output (the target verifies it), so unlike a target's head, kept at int8 for its logits' sake, a
    draft's head is one more layer to stream each pass."""
    if spec.draft_lm_head_quantization is not None:
        return spec.draft_lm_head_quantization
    return {"int4": "int4", "w4a8": "int4", "int8": "int8", "w8a8": "int8"}.get(quantization)


def _validate_draft_model(spec: SpeculativeConfig) -> None:
    if (spec.draft_vocab_size is not None or spec.draft_vocab is not None) and spec.draft_tensor_parallel_size != 1:
        raise ValueError("speculative_config.draft_vocab_size / draft_vocab need draft_tensor_parallel_size 1, "
                         f"got {spec.draft_tensor_parallel_size}")


def _check_draft_model(spec: SpeculativeConfig, tokenizer, model_config):
    """The draft must speak the target's token ids, or draft through the vocabulary intersection
    (``cross_tokenizer.py``; logged here, once per engine): its config."""
    import logging

    from specdec.engine.builder import check_vocab_compatible, load_tokenizer
    from specdec.models.loader import load_config, resolve_model_path

    draft_path = resolve_model_path(spec.model)
    draft_cfg = load_config(draft_path)
    draft_tokenizer = load_tokenizer(draft_path)
    if draft_tokenizer.get_vocab() == tokenizer.get_vocab():
        check_vocab_compatible(tokenizer, model_config, draft_tokenizer, draft_cfg, draft_path)
        return draft_cfg
    limits = [(spec.is_tree, "token trees (tree_topk > 1)"),
              (spec.draft_vocab_size is not None or spec.draft_vocab is not None, "draft_vocab_size / draft_vocab"),
              (spec.draft_tensor_parallel_size != 1, "draft_tensor_parallel_size > 1")]
    for refused, what in limits:
        if refused:
            raise ValueError(f"speculative_config: draft model {spec.model!r} has another tokenizer than the target; "
                             f"such a draft does not support {what}")
    logging.getLogger("specdec").info(
        "draft model %s has another tokenizer than the target (%d vs %d tokens): it drafts through the "
        "tokens both vocabularies share", spec.model, len(draft_tokenizer), len(tokenizer))
    return draft_cfg


def _vocab_bridge(load: DraftLoad, draft_path: str, draft_cfg):
    """The ``VocabBridge`` to the target's tokenizer, or None when the draft shares it."""
    from specdec.engine.builder import load_tokenizer, tokenizer_path
    from specdec.models.loader import resolve_model_path
    from specdec.spec_decode.vocab_bridge import VocabBridge

    target_tokenizer = load_tokenizer(tokenizer_path(load.cfg, resolve_model_path(load.cfg.model)))
    draft_tokenizer = load_tokenizer(draft_path)
    if draft_tokenizer.get_vocab() == target_tokenizer.get_vocab():
        return None
    return VocabBridge.build(target_tokenizer, draft_tokenizer, load.vocab_size, draft_cfg.vocab_size)


def _plan_draft_model(spec: SpeculativeConfig, cfg: EngineConfig, target: WeightPlan, device) -> WeightPlan:
    """The draft's own dtype, or the target's; a bf16-weights / float32-activations target gets a
    draft of the same kind (dtype "auto", no quantization, a checkpoint not kept quantized)."""
    import torch

    from specdec.models.gguf_quant import has_quantized_linears
    from specdec.models.loader import resolve_model_path
    from specdec.worker.plan import WeightPlan, bf16_weights_mode

    dtype = _draft_dtype(spec, target, device)
    widened = (target.is_widened and spec.dtype == "auto" and spec.quantization is None
               and not has_quantized_linears(resolve_model_path(spec.model)))
    return WeightPlan(torch.bfloat16 if widened else dtype, dtype, spec.quantization,
                      bf16_weights_mode(cfg.dtype if spec.dtype == "auto" else spec.dtype, dtype, device))


def _load_draft_model(load: DraftLoad) -> DraftParts:
    from specdec.layers.quantization import prepare_for_inference
    from specdec.models.loader import load_config, load_model, resolve_model_path
    from specdec.spec_decode.draft_vocab import restrict_lm_head
    from specdec.worker.model_runner import ModelRunner

    spec, weights = load.spec, load.weights
    draft_path = resolve_model_path(spec.model)
    draft_cfg = load_config(draft_path)
    draft_tp = load.tp if spec.draft_tensor_parallel_size > 1 else None
    model = load_model(draft_path, weights.load_dtype, load.device, load.attn_backend, draft_cfg, tp=draft_tp)
    draft_vocab = None
    bridge = _vocab_bridge(load, draft_path, draft_cfg)
    if bridge is not None:  # the LM head keeps the shared tokens: drafts are drawn from q restricted to them
        restrict_lm_head(model, bridge.draft_ids)
        draft_vocab = bridge.target_ids
    elif spec.draft_vocab_size is not None or spec.draft_vocab is not None:
        draft_vocab = _restrict_draft_vocab(spec, model, draft_path, min(draft_cfg.vocab_size, load.vocab_size))
    model = prepare_for_inference(model, weights.quantization, load.device, weights.bf16_weights,
                                  draft_lm_head_quantization(spec, weights.quantization))
    return DraftParts(model, weights.compute_dtype,
                      ModelRunner.kv_bytes_per_block(draft_cfg, load.cfg.block_size, weights.compute_dtype),
                      draft_vocab=draft_vocab, vocab_bridge=bridge)


def _restrict_draft_vocab(spec: SpeculativeConfig, draft_model, draft_path: str, vocab_size: int):
    """The draft's LM head cut to its draft vocabulary (``draft_vocab.py``), chosen among the ids
    the draft and the target share: the kept ids."""
    from specdec.engine.builder import load_tokenizer
    from specdec.spec_decode.draft_vocab import draft_vocabulary, restrict_lm_head

    ids = draft_vocabulary(load_tokenizer(draft_path), vocab_size, spec.draft_vocab_size, spec.draft_vocab)
    restrict_lm_head(draft_model, ids)
    return ids


def _plan_head(spec: SpeculativeConfig, cfg: EngineConfig, target: WeightPlan, device) -> WeightPlan:
    from specdec.worker.plan import WeightPlan

    dtype = _draft_dtype(spec, target, device)
    return WeightPlan(dtype, dtype, spec.quantization, None)


def _load_eagle(load: DraftLoad) -> DraftParts:
    from specdec.models.eagle import is_eagle_folder, load_head
    from specdec.models.loader import resolve_model_path
    from specdec.models.speculators import is_speculators_folder

    spec = load.spec
    path = resolve_model_path(spec.model)
    if not is_eagle_folder(path):
        hint = " (it is a speculators checkpoint: use method 'eagle3')" if is_speculators_folder(path) else ""
        raise ValueError(f"speculative_config.model {spec.model!r} is not an EAGLE head (its config.json has no "
                         f"'specdec_eagle' entry){hint}; make one with `specdec train-draft --arch eagle`")
    return _head_parts(load, load_head(path, load.target, load.weights.compute_dtype, load.device, load.attn_backend))


def _load_eagle3(load: DraftLoad) -> DraftParts:
    from specdec.models.loader import resolve_model_path
    from specdec.models.speculators import is_speculators_folder, load_eagle3

    spec = load.spec
    path = resolve_model_path(spec.model)
    if not is_speculators_folder(path):
        raise ValueError(f"speculative_config.model {spec.model!r} is not a speculators EAGLE-3 checkpoint (its "
                         f"config.json has no 'speculators_model_type'); make one with `specdec train-draft "
                         f"--arch eagle3`")
    head = load_eagle3(path, load.target, load.weights.compute_dtype, load.device, load.attn_backend)
    # the target exports these layers' inputs for the head
    return _head_parts(load, head, tuple(head.options.aux_layer_ids))


def _head_parts(load: DraftLoad, head, aux_layers: tuple[int, ...] = ()) -> DraftParts:
    """A head attached to the target (before the target's linears are packed: it copies rows of
    the target's LM head), then packed itself."""
    from specdec.layers.quantization import prepare_for_inference
    from specdec.worker.model_runner import ModelRunner

    dtype, quantization = load.weights.compute_dtype, load.weights.quantization
    head = prepare_for_inference(head, quantization, load.device,
                                 lm_head_quantization=draft_lm_head_quantization(load.spec, quantization))
    return DraftParts(head, dtype, ModelRunner.kv_bytes_per_block(head.config, load.cfg.block_size, dtype),
                      aux_layers)


def _build_draft_model(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.draft_model import DraftModelProposer

    if parts.vocab_bridge is not None:
        from specdec.spec_decode.cross_tokenizer import CrossTokenizerProposer

        limit = getattr(runner.model.config, "max_position_embeddings", None) or 1 << 30
        return CrossTokenizerProposer(runner, vocab_size, parts.vocab_bridge, limit, **_draft_args(spec))
    return DraftModelProposer(runner, vocab_size, **_draft_args(spec), draft_vocab=parts.draft_vocab)


def _build_eagle(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.eagle import EagleProposer

    return EagleProposer(runner, vocab_size, **_draft_args(spec))


def _build_eagle3(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.eagle3 import Eagle3Proposer

    return Eagle3Proposer(runner, vocab_size, **_draft_args(spec))


def _validate_ngram(spec: SpeculativeConfig) -> None:
    if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
        raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min ({spec.prompt_lookup_min}) "
                         f"<= prompt_lookup_max ({spec.prompt_lookup_max})")


def _build_ngram(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.ngram import NgramProposer
    from specdec.spec_decode.proposer import TokenListProposer

    return TokenListProposer(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.max_k), "ngram")


def _build_suffix(spec, runner, vocab_size, parts: DraftParts):
    from specdec.spec_decode.proposer import TokenListProposer
    from specdec.spec_decode.suffix import SuffixProposer

    return TokenListProposer(SuffixProposer(spec.max_k), "suffix")


_MODEL_DRAFT = dict(needs_model=True, has_draft_model=True, supports_tree=True, draft_kv_cache=True)
register_method(SpecMethod("draft_model", _build_draft_model, **_MODEL_DRAFT, supports_draft_vocab=True,
                           own_lm_head=True, validate=_validate_draft_model, check_draft=_check_draft_model,
                           plan_draft=_plan_draft_model, load=_load_draft_model))
# the target's per-batch-size graphs return the hidden states an EAGLE head reads and the head's passes
# after the first replay graphs fed its features (ModelRunner.enable_graphs(feature_size=), tested on
# CPU through the padded path); the whole EAGLE step stays eager until a GPU run checks it captured
register_method(SpecMethod("eagle", _build_eagle, **_MODEL_DRAFT, needs_target_hidden=True, graph_capturable=False,
                           plan_draft=_plan_head, load=_load_eagle))
register_method(SpecMethod("eagle3", _build_eagle3, **_MODEL_DRAFT, needs_target_hidden=True, graph_capturable=False,
                           own_lm_head=True, plan_draft=_plan_head, load=_load_eagle3))
register_method(SpecMethod("ngram", _build_ngram, validate=_validate_ngram))
register_method(SpecMethod("suffix", _build_suffix))


def _lookup_draft(part: str) -> Callable:
    """A part of the "draft_model_lookup" method (``spec_decode/lookup_draft.py``), imported on first use."""
    def call(*args):
        from specdec.spec_decode import lookup_draft

        return getattr(lookup_draft, part)(*args)
    return call


# prompt lookup where the context repeats itself, the draft model for the other requests (chains only)
register_method(SpecMethod("draft_model_lookup", _lookup_draft("build"), needs_model=True, has_draft_model=True,
                           draft_kv_cache=True, supports_draft_vocab=True, supports_prompt_lookup=True,
                           validate=_lookup_draft("validate"),
                           check_draft=_check_draft_model, plan_draft=_plan_draft_model, load=_load_draft_model),
                module=__name__)


def _mtp(part: str) -> Callable:
    """A part of the "mtp" method (``spec_decode/mtp.py``), imported on first use."""
    def call(*args):
        from specdec.spec_decode import mtp

        return getattr(mtp, part)(*args)
    return call


# the target's own multi-token-prediction layers draft, fed its hidden states like an EAGLE head
register_method(SpecMethod("mtp", _mtp("build"), has_draft_model=True, supports_tree=True, needs_target_hidden=True,
                           graph_capturable=False, validate=_mtp("validate"), plan_draft=_mtp("plan_draft"),
                           load=_mtp("load")), module=__name__)
