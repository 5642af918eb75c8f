"""Adaptive speculation length (``"num_speculative_tokens": "auto"`` with a maximum).

Pure pieces the controller wires together each step:
- ``StepCostModel`` (``cost_model.py``): forward seconds by tokens in the pass, per kind.
- ``AcceptanceEstimator`` (``acceptance.py``): per-request acceptance, per position too.
- ``ThroughputGuard`` (``throughput_guard.py``): backs off when speculating stopped paying.
- ``Explorer`` (``explorer.py``): drafts K = 1 now and then in steps planned at K = 0, within a
  budget of the plain decoding time it may lose, so such a plan keeps learning.
- ``choose_num_spec_tokens``: per-request K in 0..max_k maximising expected tokens per
  second for the whole batch.

Why the Leviathan et al. (2023) expected length E(a, K) = (1 - a^(K+1)) / (1 - a): it
follows if every draft token is accepted independently with the same probability a, so
the number accepted is a geometric variable truncated at K (+1 for the target's own
token). That gives the marginal value of the j-th draft token in closed form, a^j, which
is what makes a marginal-gain allocation over a batch cheap and well-founded. What it gets
wrong: acceptance is neither identical nor independent across positions. A draft model
drifts, so deeper positions are accepted less often than a; copy-based proposers (n-gram,
suffix) are bursty - once a copied span is being reproduced the next token is very likely,
so conditional acceptance rises with depth and the formula undervalues long drafts; and a
is not stationary within a request (code vs prose). ``choose_num_spec_tokens`` therefore
also accepts per-position conditional acceptances (from ``AcceptanceEstimator.
position_acceptance``), for which the marginal value of token j is prod_{m<=j} a_m.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from specdec.spec_decode.cost_model import StepCostModel


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target step with K drafts accepted i.i.d. w.p. alpha (incl. the
    target's own token): (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, numbers.Real) or not k >= 0:
        raise ValueError(f"k must be a number >= 0 (a mean K is fine), got {k!r}")
    if 1.0 - alpha < 1e-9:  # the closed form cancels catastrophically here; first-order expansion
        return (k + 1) - (1.0 - alpha) * k * (k + 1) / 2
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _marginal_gains(alphas: Sequence[float | Sequence[float]], max_k: int) -> np.ndarray:
    """[B, max_k] expected extra accepted tokens of each request's j-th draft token: a^j
    for a scalar a, prod_{m<=j} a_m for per-position a (the last one repeats)."""
    if isinstance(alphas, np.ndarray) and alphas.ndim == 2 and alphas.shape[1] > 0:  # [B, positions]
        per_position = np.empty((alphas.shape[0], max_k))
        width = min(max_k, alphas.shape[1])
        per_position[:, :width] = alphas[:, :width]
        per_position[:, width:] = alphas[:, width - 1: width]
    elif all(isinstance(alpha, (int, float)) for alpha in alphas):
        per_position = np.repeat(np.asarray(alphas, dtype=np.float64)[:, None], max_k, axis=1)
    else:
        per_position = np.empty((len(alphas), max_k))
        for row, alpha in enumerate(alphas):
            values = np.atleast_1d(np.asarray(alpha, dtype=np.float64))[:max_k]
            if values.size == 0:
                raise ValueError(f"alphas[{row}] must be a float or a non-empty per-position list")
            per_position[row, : values.size], per_position[row, values.size :] = values, values[-1]
    invalid = np.flatnonzero(~((per_position >= 0) & (per_position <= 1)).all(axis=1))
    if invalid.size:
        raise ValueError(f"alphas[{invalid[0]}] must be in [0, 1], got {alphas[invalid[0]]!r}")
    return np.cumprod(per_position, axis=1)


def choose_num_spec_tokens(
    alphas: Sequence[float | Sequence[float]],
    max_k: int,
    cost: StepCostModel,
    num_other_tokens: int = 0,
    draft_per_token: bool = True,
    weights: Sequence[float] | None = None,
    step_overhead: float = 0.0,
    num_requests: int | None = None,
) -> list[int]:
    """Per-request K in 0..max_k maximising the batch's tokens per second.

    Objective for choices K_i over B decoding requests plus ``num_other_tokens`` (prefill
    chunks) in the same target pass:
        (sum_i E_i(K_i) + num_other_tokens) / (overhead + draft_time + target(sum_i (K_i + 1) + num_other_tokens))
    where E_i is the expected tokens (Leviathan, or per-position products) and a prefill
    token counts as one token of progress - so when prefill already makes the pass
    compute-bound, drafts must beat the marginal cost of a real token. ``draft_time`` is
    sum over depths d of draft(#{i: K_i >= d}) for a sequential drafter
    (``draft_per_token``), or draft(#{i: K_i >= 1}) once for one that drafts all K in one
    pass; an unobserved draft kind costs 0 (n-gram).

    Search: the j-th token of request i adds gain g_ij (a_i^j), non-increasing in j, and
    the cost of a set depends only on token counts per depth, so by an exchange argument
    good sets take tokens in decreasing g_ij ("marginal-gain threshold" policies). All B *
    max_k prefixes of that order are scored exactly in one vectorised pass, so plateaus
    (flat verification then a cliff) are found; ties go to fewer tokens. K = 0 everywhere
    when no prefix beats not speculating.

    ``step_overhead``: seconds a step spends outside the forwards whatever its K (scheduling,
    sampling, commit); a step that emits several tokens pays it once, so it makes rows cheaper
    relative to a step; left out, a target whose rows are costly (a mixture-of-experts one)
    looks as if no K paid for itself where K = 2..3 does.

    ``num_requests``: the requests whose rows the target pass runs (these and the prefilling
    ones), so the pass is priced for its batch bucket (``StepCostModel.costs``); None: by rows.

    ``weights`` (one per request, in (0, 1]) value each request's tokens: the objective's
    numerator becomes sum_i w_i E_i(K_i) + num_other_tokens, the cost is unchanged (see
    ``completion_weights`` for why a request's token can be worth less than another's).
    """
    if not isinstance(max_k, int) or max_k < 0:
        raise ValueError(f"max_k must be an int >= 0, got {max_k!r}")
    if not isinstance(num_other_tokens, int) or num_other_tokens < 0:
        raise ValueError(f"num_other_tokens must be an int >= 0, got {num_other_tokens!r}")
    num_requests = len(alphas)
    if num_requests == 0 or max_k == 0:
        return [0] * num_requests
    w = np.ones(num_requests) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (num_requests,) or not ((w > 0) & (w <= 1)).all():
        raise ValueError(f"weights must be {num_requests} values in (0, 1], got {weights!r}")
    if num_requests == 1:  # tokens are taken in depth order: only the draft pass's cost per depth is needed
        gains = _marginal_gains(alphas, max_k)[0] * w[0]
        draft_one = cost.costs("draft", np.array([1.0, 0.0]))
        draft_delta = np.zeros(max_k)
        draft_delta[:max_k if draft_per_token else 1] = draft_one[0] - draft_one[1]
        owner = None
    else:
        gains = (_marginal_gains(alphas, max_k) * w[:, None]).ravel()  # [B * max_k]
        depth = np.tile(np.arange(1, max_k + 1), num_requests)  # [B * max_k]
        order = np.lexsort((depth, -gains))  # by gain desc, then depth asc
        gains, depth, owner = gains[order], depth[order], order // max_k
        # rows[t]: requests drafting at depth[t] once token t is added (its rank within its depth)
        by_depth = np.argsort(depth, kind="stable")
        group_start = np.searchsorted(depth[by_depth], depth[by_depth])
        rows = np.empty_like(depth)
        rows[by_depth] = np.arange(1, depth.shape[0] + 1) - group_start
        draft_delta = cost.costs("draft", rows) - cost.costs("draft", rows - 1)
        if not draft_per_token:
            draft_delta = np.where(depth == 1, draft_delta, 0.0)
    base_tokens = num_requests + num_other_tokens
    num_added = np.arange(gains.shape[0] + 1)  # [B * max_k + 1] prefixes
    value = float(w.sum()) + num_other_tokens + np.concatenate([[0.0], np.cumsum(gains)])
    seconds = (step_overhead + cost.costs("target", base_tokens + num_added, num_requests)
               + np.concatenate([[0.0], np.cumsum(draft_delta)]))
    throughput = value / np.maximum(seconds, 1e-30)
    best = int(np.flatnonzero(throughput >= throughput.max() * (1.0 - 1e-9))[0])
    return [best] if owner is None else np.bincount(owner[:best], minlength=num_requests).tolist()


def completion_weights(remaining_tokens: Sequence[int]) -> list[float]:
    """How much a token of each request is worth to a batch that nothing is waiting to join:
    its remaining token budget over the largest one (max_tokens - generated).

    Why: tokens/s of a step is the right objective while a queue waits (a request finished
    early hands its slot to the next one), but with no queue the batch runs until its last
    request is done and a step costs about the same with fewer requests (decode is memory-
    bound). Drafts for a request that is already ahead then buy nothing but a costlier step:
    measured on SmolLM2-135M, 4 open-ended requests of 256 tokens, n-gram "auto": the requests
    that accepted drafts finished first and the batch ran its last 40-120 steps on 1-3
    requests, 0.90-0.94x the plain engine although every speculating 4-request step emitted
    more tokens per second than a plain one. Weighting by remaining budget keeps the full
    value for the request that ends the batch and fades it for those that will finish
    earlier anyway; with equal budgets (or budgets far from reached) nothing changes."""
    top = max(remaining_tokens, default=0)
    if top <= 0:
        return [1.0] * len(remaining_tokens)
    return [min(1.0, max(r, 1) / top) for r in remaining_tokens]


def choose_num_tree_nodes(gains: Sequence[Sequence[float]], base_rows: int, cost: StepCostModel,
                          sunk_seconds: float = 0.0) -> list[int]:
    """Per request, how many of its drafted tree's nodes to verify. ``gains[i]`` holds the
    expected accepted tokens each node adds (its path's probability under the draft, calibrated),
    best first, so the nodes a request keeps are a prefix of its list, and a prefix by score is
    closed under ancestors. The step emits ``base_rows`` tokens (one per decoding request, a
    prefill chunk's tokens) plus the accepted nodes and costs the drafting already done plus
    a target pass over ``base_rows`` + nodes rows; the nodes are taken in decreasing gain while
    that ratio grows (the best prefix of all of them, scored at once; ties go to fewer nodes)."""
    flat = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), key=lambda x: -x[0])
    if not flat:
        return [0] * len(gains)
    g = np.array([x[0] for x in flat], dtype=np.float64)
    owner = np.array([x[1] for x in flat], dtype=np.int64)
    value = base_rows + np.concatenate([[0.0], np.cumsum(g)])
    seconds = sunk_seconds + cost.costs("target", base_rows + np.arange(g.shape[0] + 1))
    throughput = value / np.maximum(seconds, 1e-30)
    best = int(np.flatnonzero(throughput >= throughput.max() * (1.0 - 1e-9))[0])
    return np.bincount(owner[:best], minlength=len(gains)).tolist()
