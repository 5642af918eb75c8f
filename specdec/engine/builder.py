"""What the engine core needs to know about its models before any weights load: paths,
configs, tokenizer, context limit, EOS ids and sampling defaults (cheap; files only)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.config import EngineConfig
from specdec.engine.kv_layout import KVGroup, kv_groups
from specdec.models.loader import load_config, resolve_model_path
from specdec.spec_decode.methods import SpecMethod, method_of

MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class ModelInfo:
    model_path: str
    model_config: Any
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict
    # the target's layers grouped by sliding window, one block table each (``engine/kv_layout.py``):
    # KV behind a group's window is freed as requests advance (``KVCacheManager``)
    kv_groups: tuple[KVGroup, ...] = ()


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
    if requested is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} positions")
    return requested


def all_layers_window(config) -> int | None:
    """The sliding window if every layer of the model has one (the largest), else None."""
    from specdec.models.llama import layer_sliding_window

    windows = [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]
    return None if not windows or None in windows else max(windows)


def target_kv_groups(config, draft_config, method: SpecMethod | None) -> tuple[KVGroup, ...]:
    """Proposers without a KV cache (n-gram, suffix, replay) read no block table; a draft model
    (``draft_config``) reads the primary group's with its own window (all-sliding) or all of it; a
    head without a config of its own here (EAGLE) attends to everything."""
    from specdec.models.llama import layer_sliding_window

    windows = [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]
    draft_window = False
    if method is not None and method.draft_kv_cache:
        draft_window = all_layers_window(draft_config) if draft_config is not None else None
    return kv_groups(windows, draft_window)


def check_tree_depth(spec, configs) -> None:
    """A token tree's nodes see their ancestors through the mask alone, which needs the tree no
    deeper than the smallest sliding window of the models that read it."""
    from specdec.models.llama import layer_sliding_window

    if spec is None or not spec.is_tree:
        return
    windows = [w for c in configs if c is not None for i in range(c.num_hidden_layers)
               if (w := layer_sliding_window(c, i)) is not None]
    if windows and spec.max_k > min(windows):
        raise ValueError(f"speculative_config.num_speculative_tokens {spec.max_k} (the token tree's depth) exceeds "
                         f"the model's sliding window of {min(windows)} positions")


def tokenizer_path(cfg: EngineConfig, model_path: str) -> str:
    return resolve_model_path(cfg.tokenizer) if cfg.tokenizer else model_path


def resolve_model_info(cfg: EngineConfig) -> ModelInfo:
    path = resolve_model_path(cfg.model)
    config = load_config(path)
    tokenizer = load_tokenizer(tokenizer_path(cfg, path))
    max_model_len = _max_model_len(config, cfg.max_model_len)
    spec = cfg.speculative_config
    method = method_of(spec)
    # the method's draft, checked against the target before any weights load; drafts stay below
    # max_model_len (the scheduler caps K)
    draft_cfg = method.check_draft(spec, tokenizer, config) if method is not None else None
    draft_limit = getattr(draft_cfg, "max_position_embeddings", None)
    if draft_limit is not None and draft_limit < max_model_len:
        if cfg.max_model_len is not None:
            raise ValueError(f"max_model_len {max_model_len} exceeds the draft model's limit of "
                             f"{draft_limit} positions")
        max_model_len = draft_limit
    check_tree_depth(spec, (config, draft_cfg))
    return ModelInfo(path, config, tokenizer, max_model_len, config.vocab_size, eos_ids(path, tokenizer, config),
                     generation_defaults(path), target_kv_groups(config, draft_cfg, method))


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
