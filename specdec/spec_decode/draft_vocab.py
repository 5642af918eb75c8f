"""A draft model's reduced vocabulary (FR-Spec, Zhao et al. 2025): the draft's LM head keeps the
rows of the ``draft_vocab_size`` most frequent tokens and drafting scores only those.

Why: a small draft of a large-vocabulary target spends much of each pass in its LM head
(Qwen2.5-Coder-0.5B: 151,936 x 896, over a third of the bytes a w4a8 pass reads), while the
tokens a model writes come from a small part of it. Why it stays lossless: a draft token is
still drawn from the distribution q the draft computed, now zero outside the kept tokens, and
the rejection sampler only needs q to be the distribution the token was drawn from; a token the
target wants outside the kept set is a rejection (its residual max(0, p - q) = p there), never an
error. The price is acceptance: each time the target's token is outside the set.

Which tokens: ``token_ranking`` orders the vocabulary by a frequency table: a file of token ids
the user gives (most frequent first: a JSON list, or a 1-D tensor saved with ``torch.save`` as
SGLang's ``--speculative-token-map`` is), or else token counts over the Python standard library's
source (code, comments and docstrings; computed once per tokenizer and cached), taken in turn
with the tokenizer's own id order (byte-pair merge rank, earlier merges being more frequent in
the tokenizer's training text) so that prose keeps its common words too. The special tokens
(end of turn, end of text) are always kept.
"""
from __future__ import annotations

import collections
import hashlib
import json
import sysconfig
from pathlib import Path

import torch
from torch import nn

def cache_dir() -> Path:
    from specdec.models.hub import cache_dir as specdec_cache

    return specdec_cache() / "draft_vocab"


def load_token_file(path: str, vocab_size: int) -> list[int]:
    """Token ids, most frequent first, from a JSON list or a ``torch.save``d 1-D integer tensor."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"speculative_config.draft_vocab: no file {path!r}")
    try:
        if file.suffix == ".json":
            ids = json.loads(file.read_text())
        else:
            ids = torch.load(file, map_location="cpu", weights_only=True)
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear error
        raise ValueError(f"speculative_config.draft_vocab: cannot read {path!r} as a JSON list or a saved "
                         f"tensor of token ids ({type(e).__name__}: {e})") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"speculative_config.draft_vocab: {path!r} must hold a list of token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"speculative_config.draft_vocab: token id {bad[0]} in {path!r} is outside the "
                         f"vocabulary (0..{vocab_size - 1})")
    return list(dict.fromkeys(ids))


def stdlib_token_counts(tokenizer) -> collections.Counter:
    """Token counts over the standard library's non-test ``.py`` files (cached per tokenizer)."""
    vocab = tokenizer.get_vocab()
    key = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    cached = cache_dir() / f"stdlib-{key}.json"
    if cached.is_file():
        return collections.Counter({int(t): c for t, c in json.loads(cached.read_text()).items()})
    root = Path(sysconfig.get_paths()["stdlib"])
    counts: collections.Counter = collections.Counter()
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "site-packages", "idle_test"} & set(path.relative_to(root).parts):
            continue
        counts.update(tokenizer(path.read_text(encoding="utf-8", errors="replace"),
                                add_special_tokens=False)["input_ids"])
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(t): c for t, c in counts.items()}))
    tmp.replace(cached)
    return counts


def token_ranking(tokenizer, vocab_size: int, token_file: str | None = None) -> list[int]:
    """Every token id once, the most frequent first (module docstring)."""
    if token_file is not None:
        ranked = load_token_file(token_file, vocab_size)
    else:
        counted = [t for t, _ in sorted(stdlib_token_counts(tokenizer).items(), key=lambda tc: (-tc[1], tc[0]))
                   if t < vocab_size]
        ranked = _interleave(counted, list(range(vocab_size)))
    kept = set(ranked)
    return ranked + [t for t in range(vocab_size) if t not in kept]


def _interleave(first: list[int], second: list[int]) -> list[int]:
    """first[0], second[0], first[1], second[1], ... (the longer list's tail after), each id once."""
    out = [t for pair in zip(first, second) for t in pair]
    n = min(len(first), len(second))
    return list(dict.fromkeys(out + first[n:] + second[n:]))


def draft_vocabulary(tokenizer, vocab_size: int, size: int | None, token_file: str | None = None) -> torch.Tensor:
    """[n] int64, ascending: the kept token ids (``size`` of them, or all of ``token_file``'s when
    ``size`` is None), the tokenizer's special tokens included."""
    if size is None:
        ids = load_token_file(token_file, vocab_size)
    else:
        if not 1 <= size <= vocab_size:
            raise ValueError(f"speculative_config.draft_vocab_size must be in 1..{vocab_size} "
                             f"(the draft's vocabulary), got {size}")
        ids = token_ranking(tokenizer, vocab_size, token_file)[:size]
    special = [t for t in getattr(tokenizer, "all_special_ids", []) if 0 <= t < vocab_size]
    return torch.tensor(sorted(set(ids) | set(special)), dtype=torch.long)


def restrict_lm_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Module transform (before quantization): ``model.lm_head`` keeps the rows of ``token_ids``, so
    the model's logits are over those tokens in that order. A tied head gets its own copy."""
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"speculative_config.draft_vocab_size needs the draft's LM head as a plain linear "
                         f"layer, got {type(head).__name__}")
    small = nn.Linear(head.in_features, len(token_ids), bias=head.bias is not None,
                      device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        small.weight.copy_(head.weight[token_ids.to(head.weight.device)])
        if head.bias is not None:
            small.bias.copy_(head.bias[token_ids.to(head.bias.device)])
    small.requires_grad_(False)
    model.lm_head = small
