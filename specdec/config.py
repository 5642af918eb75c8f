"""EngineConfig and SpeculativeConfig: slotted dataclasses validated on construction."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields

from specdec.spec_decode.methods import get_method, registered_methods

MAX_SPEC_TOKENS = 16
MAX_TREE_TOPK = 8
MAX_TREE_NODES = 64
# "w8a8" / "w4a8": the int8 / int4 weights of "int8" / "int4" with int8 activations (CPU: VNNI or AVX2)
QUANTIZATION_METHODS = (None, "int8", "int4", "w8a8", "w4a8", "int8_dynamic", "fp8")
# an LM head's own weight format (``draft_lm_head_quantization``), for a model in one of the integer formats
LM_HEAD_QUANTIZATIONS = ("int8", "int4")
INTEGER_QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")
ATTENTION_BACKENDS = ("auto", "reference", "torch", "rows", "triton")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "draft_model"
    # draft model (method "draft_model"), EAGLE head folder ("eagle") or speculators EAGLE-3 checkpoint
    # ("eagle3"; given without a method, such a checkpoint sets the method and K from its config)
    model: str | None = None
    num_speculative_tokens: int | str = 5  # an int in 1..16, or "auto" (adaptive, up to max_num_speculative_tokens)
    max_num_speculative_tokens: int = 8  # the ceiling for "auto"
    dtype: str = "auto"  # the draft's own dtype ("auto": the target's)
    quantization: str | None = None  # one of QUANTIZATION_METHODS, for the draft
    # the draft's own LM head (methods "draft_model", "eagle3"; an integer ``quantization``): "int8" or
    # "int4" weights; None: the draft's weight format (int4 for "int4" / "w4a8", int8 for "int8" / "w8a8").
    # The target verifies every draft, so the head's format trades draft speed against acceptance only
    draft_lm_head_quantization: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    acceptance: float = 0.8  # "replay" (benchmark only, ``specdec.bench.replay``): probability a proposed token is kept
    # token trees (methods "eagle", "eagle3" and "draft_model"): the draft keeps its top ``tree_topk``
    # candidates per expanded node, expands the ``tree_topk`` likeliest nodes of each depth up to K,
    # and sends its ``tree_nodes`` likeliest nodes to verification (``specdec.spec_decode.tree``); 1 = a chain.
    # With K "auto" the depth is planned per request and ``tree_nodes`` is a ceiling: the nodes whose
    # expected acceptance pays for their verification rows under the measured step costs are sent
    tree_topk: int = 1
    tree_nodes: int | None = None  # default: 3 * K (3 * max_num_speculative_tokens for "auto")
    # tensor parallelism: 1 runs a whole draft model on every rank; the target's size shards it too
    draft_tensor_parallel_size: int = 1
    # method "draft_model": the draft's LM head keeps only this many of the most frequent tokens
    # (``specdec.spec_decode.draft_vocab``; frequencies from ``draft_vocab``, a file of token ids most
    # frequent first, or a built-in table); given alone, ``draft_vocab`` keeps every token it lists
    draft_vocab_size: int | None = None
    draft_vocab: str | None = None
    # chains drafted by a model (draft_model, eagle, eagle3, mtp): a request stops drafting at the
    # first draft token whose probability under the draft (temperature 1) is below this; 0 = K always
    draft_confidence_threshold: float = 0.0
    # method "draft_model_lookup": when a request's prompt lookup replaces its draft model, e.g.
    # {"source": "ngram", "min_match": 3, "max_match": 8, "min_tokens": 2} (``spec_decode/lookup_draft.py``)
    prompt_lookup: dict | None = None

    def __post_init__(self) -> None:
        method = get_method(self.method)  # the method's own checks run last, on a config checked here
        if method.needs_model and not self.model:
            raise ValueError(f"speculative_config.model (the draft model or head) is required for method "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if k == "auto":
            if not 1 <= self.max_num_speculative_tokens <= MAX_SPEC_TOKENS:
                raise ValueError(
                    f"speculative_config.max_num_speculative_tokens must be in 1..{MAX_SPEC_TOKENS}, "
                    f"got {self.max_num_speculative_tokens}"
                )
        elif not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in 1..{MAX_SPEC_TOKENS} or 'auto', got {k!r}")
        if (self.draft_vocab_size is not None or self.draft_vocab is not None) and not method.supports_draft_vocab:
            raise ValueError(f"speculative_config.draft_vocab_size / draft_vocab apply to method "
                             f"{_either(n for n, m in registered_methods().items() if m.supports_draft_vocab)}, "
                             f"got {self.method!r} (EAGLE heads carry their own draft vocabulary)")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or isinstance(self.draft_vocab_size, bool)):
            raise ValueError(f"speculative_config.draft_vocab_size must be an int, got {self.draft_vocab_size!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"speculative_config.quantization must be one of {QUANTIZATION_METHODS}, "
                             f"got {self.quantization!r}")
        self._check_draft_lm_head(method)
        if not isinstance(self.tree_topk, int) or not 1 <= self.tree_topk <= MAX_TREE_TOPK:
            raise ValueError(f"speculative_config.tree_topk must be in 1..{MAX_TREE_TOPK}, got {self.tree_topk!r}")
        if self.tree_nodes is not None and (not isinstance(self.tree_nodes, int)
                                            or not 1 <= self.tree_nodes <= MAX_TREE_NODES):
            raise ValueError(f"speculative_config.tree_nodes must be in 1..{MAX_TREE_NODES}, got {self.tree_nodes!r}")
        c = self.draft_confidence_threshold
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:
            raise ValueError(f"speculative_config.draft_confidence_threshold must be in [0, 1), got {c!r}")
        if c and (not method.has_draft_model or self.tree_topk > 1):
            raise ValueError(f"speculative_config.draft_confidence_threshold applies to chains drafted by a model "
                             f"({_either(n for n, m in registered_methods().items() if m.has_draft_model)}, "
                             f"tree_topk 1), got method {self.method!r} with tree_topk {self.tree_topk}")
        if self.is_tree and not method.supports_tree:
            raise ValueError(f"speculative_config.tree_topk > 1 needs method "
                             f"{_either(n for n, m in registered_methods().items() if m.supports_tree)} (a draft "
                             f"that scores candidates), got {self.method!r}")
        if self.prompt_lookup is not None and not method.supports_prompt_lookup:
            raise ValueError(f"speculative_config.prompt_lookup applies to method "
                             f"{_either(n for n, m in registered_methods().items() if m.supports_prompt_lookup)}, "
                             f"got {self.method!r}")
        method.validate(self)

    def _check_draft_lm_head(self, method) -> None:
        head = self.draft_lm_head_quantization
        if head is None:
            return
        if head not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"speculative_config.draft_lm_head_quantization must be one of "
                             f"{LM_HEAD_QUANTIZATIONS} or None, got {head!r}")
        if not method.own_lm_head:
            raise ValueError(f"speculative_config.draft_lm_head_quantization applies to method "
                             f"{_either(n for n, m in registered_methods().items() if m.own_lm_head)} (a draft "
                             f"with its own LM head), got {self.method!r}")
        if self.quantization not in INTEGER_QUANTIZATIONS:
            raise ValueError(f"speculative_config.draft_lm_head_quantization needs speculative_config.quantization "
                             f"one of {INTEGER_QUANTIZATIONS} (the draft's weights), got {self.quantization!r}")

    @property
    def is_adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def max_k(self) -> int:
        return self.max_num_speculative_tokens if self.is_adaptive else int(self.num_speculative_tokens)

    @property
    def is_tree(self) -> bool:
        return self.tree_topk > 1

    @property
    def num_tree_nodes(self) -> int:
        return self.tree_nodes if self.tree_nodes is not None else 3 * self.max_k

    @property
    def num_spec_slots(self) -> int:
        """KV slots a request reserves for drafts: K for a chain; for a tree the nodes verified,
        or the nodes its draft expands if more (they are written to the draft's cache)."""
        if not self.is_tree:
            return self.max_k
        return max(self.num_tree_nodes, self.tree_topk * (self.max_k - 1))

    @classmethod
    def from_any(cls, value, **legacy) -> SpeculativeConfig | None:
        """dict / JSON string / SpeculativeConfig / None, plus the old keyword form."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if value is None and legacy.get("speculative_model"):
            value = {"method": "draft_model", "model": legacy["speculative_model"]}
            if legacy.get("num_speculative_tokens") is not None:
                value["num_speculative_tokens"] = legacy["num_speculative_tokens"]
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        if "method" not in value and value.get("model") and os.path.isdir(value["model"]):
            from specdec.models.speculators import speculative_defaults

            value = {**(speculative_defaults(value["model"]) or {}), **value}  # as vLLM: the checkpoint says
        return cls(**value)


def _either(names: Iterable[str]) -> str:
    """'a', 'b' or 'c'"""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


@dataclass(slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped at 8192)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # bytes of KV cache (default on CPU: 2 GiB, or what max_num_seqs * max_model_len needs if less;
    # on a GPU: what gpu_memory_utilization leaves)
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    quantization: str | None = None  # "int8" / "int4" (weight-only) or "fp8" for the target (the quantized model is the target)
    speculative_config: SpeculativeConfig | None = None
    # "reference" (per-request loop), "torch" (batched matmuls), "rows" (CPU, each query row on its own:
    # what "auto" picks for the int8-activation quantizations on CPU) or "triton" (GPU)
    attention_backend: str = "auto"
    num_threads: int | None = None
    enforce_eager: bool = False  # GPUs: no CUDA/HIP graphs for decode and verify steps (as vLLM's flag)
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    spec_cost_calibration: bool = True
    tensor_parallel_size: int = 1  # ranks the target is sharded over (one process per rank)
    # structured output: append the tokens a grammar forces (the only one it allows) without a
    # target decision; lossless, since the constrained target gives them probability 1
    structured_outputs_forced_tokens: bool = True
    # LoRA adapters (vLLM's names): requests may name an adapter (``LoRARequest``); at most
    # ``max_loras`` distinct adapters run in one step, each of rank <= ``max_lora_rank``
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "max_loras",
                     "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        spec = self.speculative_config
        if spec is not None and spec.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                             f"({self.tensor_parallel_size}), got {spec.draft_tensor_parallel_size!r}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens < self.max_model_len:
            self.max_num_batched_tokens = self.max_model_len

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        from specdec.models.speculators import override_with_speculators

        # a speculators checkpoint as the model: its verifier is the target, the checkpoint the draft
        model, tokenizer, spec_value = override_with_speculators(model, kwargs.pop("tokenizer", None),
                                                                 kwargs.pop("speculative_config", None))
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        spec = SpeculativeConfig.from_any(
            spec_value,
            speculative_model=kwargs.pop("speculative_model", None),
            num_speculative_tokens=kwargs.pop("num_speculative_tokens", None),
        )
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine argument(s) {sorted(unknown)}")
        return cls(model=model, speculative_config=spec, **kwargs)
