"""Suffix-decoding proposer (Oliaro et al. 2024, "SuffixDecoding"): draft-free speculation
from the request's own context AND a bounded global store of earlier requests' outputs.

What it does, per request and step: take the context's longest suffix (up to
``max_depth`` tokens) that occurs earlier in a source, collect every occurrence of that
pattern, and walk forward along the most frequent next token among the occurrences still
agreeing with the walk (ties -> most recent). The walk multiplies the frequencies into a
path probability and stops below ``min_token_prob`` or at ``spec_factor * match_length``
tokens (short matches are weak evidence, so they get short drafts). Two sources are
searched - the request's prompt + output, and the global store - and the draft with the
larger expected accepted length (sum of path probabilities) wins.

Why this beats prompt lookup on agentic / code-editing traffic:
- much longer patterns (32 vs ~3-5 tokens) pin down *which* copy of a repeated code line
  is being reproduced, where "most recent 3-gram" jumps to the wrong one;
- the global store proposes text that is in no prompt: the boilerplate of tool calls,
  diff headers and explanations that similar requests of the same process keep emitting;
- frequency instead of recency when several occurrences disagree, and draft length by
  match confidence, so weak matches don't waste verification slots.

Why numpy indexes instead of a pointer suffix tree: a Python suffix tree costs hundreds
of bytes and per-token interpreter work per node on every append. The context is already
a numpy array (one vectorised scan per step, like ``ngram.py``), and the global store is
one flat token array with a sorted bigram index (a suffix-array-like structure rebuilt
with numpy argsort, amortised O(log N) per stored token) plus a linear scan of the
not-yet-indexed tail. It returns the same occurrence sets a suffix tree would at the
longest matched depth. Simplifications vs the paper: linear drafts (no token trees yet),
and only the longest pattern is scored rather than every pattern length.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.spec_decode.ngram import (
    TokenArrayCache,
    check_batch_lengths,
    common_suffix_lengths,
    earlier_match_ends,
    validate_num_speculative_tokens,
)


def draft_from_occurrences(
    haystack: np.ndarray, ends: np.ndarray, max_len: int, min_token_prob: float
) -> tuple[list[int], float]:
    """Greedy most-frequent walk forward from pattern occurrences ending at ``ends``
    (ascending positions). Returns (draft, score = sum of path probabilities).
    Negative haystack ids are sequence separators: an occurrence that reaches one drops out."""
    num_haystack = haystack.shape[0]
    if ends.shape[0] == 1:  # one occurrence: copy its run up to a separator
        run = haystack[int(ends[0]) + 1 : int(ends[0]) + 1 + max_len]
        separators = np.flatnonzero(run < 0)
        draft = (run[: separators[0]] if separators.size else run).tolist()
        return draft, float(len(draft))
    idx = ends[:, None] + np.arange(1, max_len + 1)  # [C, max_len]
    window = np.where(idx < num_haystack, haystack[np.minimum(idx, num_haystack - 1)], -1)
    alive = np.arange(ends.shape[0])
    draft, prob, score = [], 1.0, 0.0
    while len(draft) < max_len and alive.size:
        step = len(draft)
        columns = window[alive, step:]  # [A, max_len - step]
        newest = columns[-1]
        agree = (columns == newest).all(axis=0) & (newest >= 0)
        run = agree.shape[0] if agree.all() else int(agree.argmin())
        if run:  # every surviving occurrence continues the same way: take the run at once
            draft.extend(newest[:run].tolist())
            score += prob * run
            continue
        column = columns[:, 0]
        alive, column = alive[column >= 0], column[column >= 0]
        if alive.size == 0:
            break
        token, count = _most_frequent_latest(column)
        prob *= count / alive.size
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        alive = alive[column == token]
    return draft, score


def _most_frequent_latest(values: np.ndarray) -> tuple[int, int]:
    """(most frequent value, its count); ties go to the value seen last (most recent)."""
    if values.shape[0] <= 64:  # a dict beats np.unique's sort below ~64 values
        counts: dict[int, int] = {}
        for value in values.tolist():
            counts[value] = counts.get(value, 0) + 1
        best = max(counts.values())
        return next(v for v in reversed(values.tolist()) if counts[v] == best), best
    unique, counts = np.unique(values, return_counts=True)
    best = int(counts.max())
    tied = unique[counts == best]
    return int(tied[0] if tied.size == 1 else values[np.isin(values, tied)][-1]), best


class GlobalTokenStore:
    """Bounded store of finished requests' tokens: one flat array with -1 between
    sequences, indexed by bigram (previous, last) -> end positions.

    The index is a log-structured set of sorted (key, position) segments, oldest and
    largest first, plus a linearly scanned tail of at most ``tail_tokens`` tokens. A full
    tail becomes a segment; adjacent segments merge while the newer is at least half the
    older, so there are O(log N) segments and each token is re-sorted O(log N) times
    (merges are a stable sort of two sorted runs: linear time). When the store exceeds
    ``max_tokens`` the oldest sequences are evicted down to 3/4 of it.
    """

    def __init__(self, max_tokens: int, tail_tokens: int = 4096):
        self.max_tokens = max_tokens
        self.tail_tokens = tail_tokens
        self.tokens = np.full(1024, -1, dtype=np.int64)
        self.num_tokens = 0
        self.sequence_starts: list[int] = []
        self.segments: list[tuple[np.ndarray, np.ndarray]] = []  # (keys [n] sorted, end positions [n])
        self.num_indexed = 0  # tokens[:num_indexed] are in segments

    def add(self, tokens: np.ndarray) -> None:
        tokens = tokens[-(self.max_tokens // 2):]
        needed = tokens.shape[0] + 1
        if self.num_tokens + needed > self.max_tokens:
            self._evict(self.max_tokens * 3 // 4 - needed)
        if self.num_tokens + needed > self.tokens.shape[0]:
            grown = np.full(max(2 * self.tokens.shape[0], self.num_tokens + needed), -1, dtype=np.int64)
            grown[: self.num_tokens] = self.tokens[: self.num_tokens]
            self.tokens = grown
        self.sequence_starts.append(self.num_tokens)
        self.tokens[self.num_tokens : self.num_tokens + needed - 1] = tokens
        self.tokens[self.num_tokens + needed - 1] = -1
        self.num_tokens += needed
        if self.num_tokens - self.num_indexed > self.tail_tokens:
            self._index_tail()

    def _index_tail(self) -> None:
        ends = np.arange(max(self.num_indexed, 1), self.num_tokens)
        ends = ends[(self.tokens[ends - 1] >= 0) & (self.tokens[ends] >= 0)]
        keys = (self.tokens[ends - 1] << 32) | self.tokens[ends]
        order = np.argsort(keys, kind="stable")
        self.segments.append((keys[order], ends[order]))
        self.num_indexed = self.num_tokens
        while len(self.segments) > 1 and self.segments[-2][0].shape[0] <= 2 * self.segments[-1][0].shape[0]:
            (older_keys, older_ends), (newer_keys, newer_ends) = self.segments.pop(-2), self.segments.pop()
            keys, ends = np.concatenate([older_keys, newer_keys]), np.concatenate([older_ends, newer_ends])
            order = np.argsort(keys, kind="stable")  # stable: positions stay ascending within a key
            self.segments.append((keys[order], ends[order]))

    def _evict(self, target_tokens: int) -> None:
        drop = 0
        while drop < len(self.sequence_starts) and self.num_tokens - self.sequence_starts[drop] > max(target_tokens, 0):
            drop += 1
        cut = self.sequence_starts[drop] if drop < len(self.sequence_starts) else self.num_tokens
        kept = self.tokens[cut : self.num_tokens].copy()
        self.tokens[: kept.shape[0]] = kept
        self.tokens[kept.shape[0] : self.num_tokens] = -1
        self.num_tokens = kept.shape[0]
        self.num_indexed = max(self.num_indexed - cut, 0)
        self.sequence_starts = [start - cut for start in self.sequence_starts[drop:]]
        segments, self.segments = self.segments, []
        for keys, ends in segments:
            keep = ends > cut  # an end at `cut` would pair with the evicted separator before it
            if keep.any():
                self.segments.append((keys[keep], ends[keep] - cut))

    def occurrences(self, previous: int, last: int, max_candidates: int) -> np.ndarray:
        """Ascending end positions e with tokens[e-1:e+1] == [previous, last], most recent
        ``max_candidates`` only."""
        key = (previous << 32) | last
        found = []
        for keys, ends in self.segments:
            lo, hi = np.searchsorted(keys, (key, key + 1))
            if hi > lo:
                found.append(ends[max(lo, hi - max_candidates) : hi])
        start = max(self.num_indexed - 1, 0)
        tail = self.tokens[start : self.num_tokens]
        found.append(np.flatnonzero((tail[:-1] == previous) & (tail[1:] == last)) + start + 1)
        return np.concatenate(found)[-max_candidates:]


class SuffixProposer:
    def __init__(
        self,
        num_speculative_tokens: int,
        max_depth: int = 32,
        spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_store_tokens: int = 1 << 20,
        store_prompt_tail: int = 16,
        max_candidates: int = 64,
    ):
        validate_num_speculative_tokens(num_speculative_tokens)
        for name, value, low in (("max_depth", max_depth, 2), ("max_store_tokens", max_store_tokens, 0),
                                 ("store_prompt_tail", store_prompt_tail, 0), ("max_candidates", max_candidates, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not spec_factor > 0:
            raise ValueError(f"spec_factor must be > 0, got {spec_factor!r}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        self.store_prompt_tail = store_prompt_tail
        self.max_candidates = max_candidates
        self.store = GlobalTokenStore(max_store_tokens)
        self._token_arrays = TokenArrayCache()
        self._num_prompt_tokens: dict[str, int] = {}  # context length at the first propose

    def propose(
        self, token_ids: list[Sequence[int]], num_tokens: list[int], request_ids: list[str]
    ) -> list[list[int]]:
        check_batch_lengths(token_ids, num_tokens, request_ids)
        drafts = []
        for tokens, num_wanted, request_id in zip(token_ids, num_tokens, request_ids):
            if request_id not in self._num_prompt_tokens:
                if len(self._num_prompt_tokens) >= self._token_arrays.max_requests:  # finish never came
                    del self._num_prompt_tokens[next(iter(self._num_prompt_tokens))]
                self._num_prompt_tokens[request_id] = len(tokens)
            k = min(num_wanted, self.num_speculative_tokens)
            drafts.append(self._propose_one(self._token_arrays.view(request_id, tokens), k) if k > 0 else [])
        return drafts

    def _propose_one(self, context: np.ndarray, k: int) -> list[int]:
        num_context = context.shape[0]
        if num_context < 2:
            return []
        local_ends = earlier_match_ends(context, 1, self.max_depth)
        draft, score = self._draft_from_source(context, local_ends, context, k)
        if score >= k or self.store.max_tokens == 0:  # a certain full-length draft can't be beaten
            return draft
        global_ends = self.store.occurrences(int(context[-2]), int(context[-1]), self.max_candidates)
        global_draft, global_score = self._draft_from_source(self.store.tokens, global_ends, context, k)
        return global_draft if global_score > score else draft  # ties: the request's own context

    def _draft_from_source(
        self, haystack: np.ndarray, ends: np.ndarray, context: np.ndarray, k: int
    ) -> tuple[list[int], float]:
        if ends.size == 0:
            return [], 0.0
        lengths = common_suffix_lengths(haystack, ends, context[-self.max_depth:])
        match_length = int(lengths.max())
        ends = ends[lengths == match_length][-self.max_candidates:]
        max_len = min(k, max(1, int(self.spec_factor * match_length)))
        return draft_from_occurrences(haystack, ends, max_len, self.min_token_prob)

    def reset_history(self) -> None:
        """Empty the global store of earlier outputs (in-flight requests keep their own context)."""
        self.store = GlobalTokenStore(self.store.max_tokens)

    def on_request_finished(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int | None = None
    ) -> None:
        """Learn the request's output (plus ``store_prompt_tail`` prompt tokens of context).
        Without ``num_prompt_tokens`` the context length at the first ``propose`` is used."""
        first_seen = self._num_prompt_tokens.pop(request_id, len(token_ids))
        self._token_arrays.drop(request_id)
        num_prompt = first_seen if num_prompt_tokens is None else num_prompt_tokens
        if len(token_ids) > num_prompt and self.store.max_tokens > 0:
            start = max(0, num_prompt - self.store_prompt_tail)
            self.store.add(np.asarray(token_ids[start:], dtype=np.int64))
