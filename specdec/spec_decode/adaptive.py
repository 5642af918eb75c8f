"""Adaptive speculation length (``"num_speculative_tokens": "auto"`` with a maximum).

Three pure pieces the engine wires together each step:
- ``StepCostModel``: measured forward-pass seconds as a function of the number of tokens in
  the pass, per kind ("target", "draft"), piecewise-linear over token-count knots with EMA
  updates; ``calibrate`` times a callable at start-up, ``observe`` refines it every step.
- ``AcceptanceEstimator``: per-request acceptance (scalar and per-position), Beta counts with
  exponential forgetting, shrunk towards a pooled estimate over all requests.
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

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

KINDS = ("target", "draft")
DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target step with K drafts accepted i.i.d. w.p. alpha (incl. the
    target's own token): (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if 1.0 - alpha < 1e-9:  # the closed form cancels catastrophically here; first-order expansion
        return (k + 1) - (1.0 - alpha) * k * (k + 1) / 2
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _validate_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


class StepCostModel:
    """Seconds per forward pass vs tokens in the pass, per kind. Knots at ``token_counts``;
    linear between observed knots, flat below the first, and beyond the last observed knot
    the last observed segment's slope continues (flat with one observed knot). That is
    optimistic on purpose: an over-estimate would stop speculation and with it the
    observations that would correct it; an under-estimate is corrected by the next step's
    measurement. Observations above the last knot fold into it proportionally (compute-
    bound). Each observation is a least-mean-squares step on the
    two neighbouring knots (weights = hat functions), with step max(ema_rate, 1/mass) so a
    knot averages its first observations and then tracks drift as an EMA. An unobserved
    kind costs 1.0 flat for "target" (memory-bound, see DESIGN.md) and 0.0 for "draft" (the
    n-gram / suffix proposers)."""

    def __init__(self, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, ema_rate: float = 0.05):
        counts = list(token_counts)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts) or counts != sorted(set(counts)):
            raise ValueError(f"token_counts must be strictly increasing ints >= 1, got {token_counts!r}")
        if not 0.0 < ema_rate <= 1.0:
            raise ValueError(f"ema_rate must be in (0, 1], got {ema_rate!r}")
        self.token_counts = np.asarray(counts, dtype=np.float64)  # [num_knots]
        self.ema_rate = ema_rate
        self._seconds = {kind: np.zeros(len(counts)) for kind in KINDS}  # [num_knots]
        self._mass = {kind: np.zeros(len(counts)) for kind in KINDS}  # [num_knots] observation weight
        self._calibrated = {kind: np.zeros(len(counts)) for kind in KINDS}  # [num_knots] set() values
        self._observed = {kind: np.zeros(len(counts), dtype=bool) for kind in KINDS}  # [num_knots] by observe()

    def has_observations(self, kind: str) -> bool:
        _validate_kind(kind)
        return bool(self._mass[kind].any())

    def observe(self, kind: str, num_tokens: int, seconds: float) -> None:
        _validate_kind(kind)
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        knots, values, mass = self.token_counts, self._seconds[kind], self._mass[kind]
        if num_tokens > knots[-1]:  # fold into the last knot under the proportional assumption
            seconds, num_tokens = seconds * knots[-1] / num_tokens, knots[-1]
        num_tokens = max(num_tokens, knots[0])
        hi = min(int(np.searchsorted(knots, num_tokens)), len(knots) - 1)
        lo = hi if knots[hi] == num_tokens else hi - 1
        w_hi = 1.0 if lo == hi else (num_tokens - knots[lo]) / (knots[hi] - knots[lo])
        residual = seconds - (self.cost(kind, num_tokens) if mass.any() else seconds)
        fresh = [knot for knot in {lo, hi} if not self._observed[kind][knot]]
        if fresh:  # a calibration-only knot starts from its rescaled value
            values[fresh] = self._knot_values(kind)[fresh]
        for knot, weight in ((lo, 1.0 - w_hi), (hi, w_hi)) if lo != hi else ((hi, 1.0),):
            if weight <= 0.0:
                continue
            if mass[knot] == 0.0:
                values[knot] = seconds
            else:
                values[knot] += max(self.ema_rate, weight / (mass[knot] + weight)) * weight * residual
                values[knot] = max(values[knot], 0.0)  # the two-knot LMS step can overshoot below 0
            mass[knot] += weight
            self._observed[kind][knot] = True

    def set(self, kind: str, num_tokens: int, seconds: float) -> None:
        """Overwrite a knot with a trusted measurement (calibration)."""
        _validate_kind(kind)
        matches = np.flatnonzero(self.token_counts == num_tokens)
        if matches.size == 0:
            raise ValueError(f"num_tokens={num_tokens} is not a knot of this model ({self.token_counts.tolist()})")
        self._seconds[kind][matches[0]] = seconds
        self._mass[kind][matches[0]] = max(self._mass[kind][matches[0]], 1.0)
        self._calibrated[kind][matches[0]] = seconds
        self._observed[kind][matches[0]] = False

    def _knot_values(self, kind: str) -> np.ndarray:
        """Knot seconds, with knots known only from calibration rescaled by the observed /
        calibrated ratio of the nearest knots that real steps have since measured. Start-up
        calibration runs short contexts; real steps (long contexts, sampling) can cost twice
        as much, and a curve mixing updated and stale knots would say that going from the
        observed 32 tokens to the stale 64 is nearly free (measured at batch 32: 56 ms observed
        at 32 tokens vs 46 ms calibrated at 64), which made "auto" speculate where it did not pay."""
        values, calibrated = self._seconds[kind], self._calibrated[kind]
        anchors = np.flatnonzero(self._observed[kind] & (calibrated > 0))
        stale = np.flatnonzero(~self._observed[kind] & (calibrated > 0))
        if anchors.size == 0 or stale.size == 0:
            return values
        values = values.copy()
        ratios = values[anchors] / calibrated[anchors]
        values[stale] = calibrated[stale] * np.interp(stale, anchors, ratios)  # flat beyond the ends
        return values

    def costs(self, kind: str, num_tokens: np.ndarray) -> np.ndarray:
        """Vectorised ``cost``: num_tokens [N] -> seconds [N]."""
        _validate_kind(kind)
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        observed = self._mass[kind] > 0
        if not observed.any():
            return np.where(num_tokens > 0, 1.0 if kind == "target" else 0.0, 0.0)
        knots, values = self.token_counts[observed], self._knot_values(kind)[observed]
        # a pass over more tokens never costs less: knots fed by different step mixes (prefill
        # chunks, long and short contexts) can disagree, and a dip would read as free tokens
        values = np.maximum.accumulate(values)
        slope = max(0.0, (values[-1] - values[-2]) / (knots[-1] - knots[-2])) if knots.shape[0] > 1 else 0.0
        inside = np.interp(num_tokens, knots, values)
        beyond = values[-1] + slope * (num_tokens - knots[-1])
        return np.where(num_tokens <= 0, 0.0, np.where(num_tokens > knots[-1], beyond, inside))

    def cost(self, kind: str, num_tokens: int) -> float:
        return float(self.costs(kind, np.asarray([num_tokens]))[0])

    def calibrate(
        self,
        run_fn: Callable[[str, int], object],
        kinds: Sequence[str] = ("target",),
        token_counts: Sequence[int] | None = None,
        num_warmup: int = 1,
        num_repeats: int = 3,
        timer: Callable[[], float] = time.perf_counter,
    ) -> dict[tuple[str, int], float]:
        """Time ``run_fn(kind, num_tokens)`` (which must block until the device is done, e.g.
        end with torch.cuda.synchronize()) and store the median of ``num_repeats`` runs;
        knots are overwritten, other counts are observed. Returns {(kind, n): seconds}."""
        measured = {}
        for kind in kinds:
            _validate_kind(kind)
            for num_tokens in token_counts or [int(n) for n in self.token_counts if n <= 64]:
                for _ in range(num_warmup):
                    run_fn(kind, num_tokens)
                samples = []
                for _ in range(max(1, num_repeats)):
                    start = timer()
                    run_fn(kind, num_tokens)
                    samples.append(timer() - start)
                seconds = float(np.median(samples))
                if num_tokens in self.token_counts:
                    self.set(kind, num_tokens, seconds)
                else:
                    self.observe(kind, num_tokens, seconds)
                measured[(kind, num_tokens)] = seconds
        return measured


class AcceptanceEstimator:
    """Per-request acceptance from (num_drafted, num_accepted) outcomes. Under the i.i.d.
    model a step that accepted A of K drafts is A successes plus one failure if A < K; the
    estimate is the Beta posterior mean with counts decayed by ``decay`` per update (memory
    ~ 1/(1 - decay) steps) and a prior of ``prior_strength`` pseudo-trials at the pooled
    estimate of all requests (itself starting at ``prior_acceptance``). Per position j the
    same counts give the conditional P(accept j | accepted 1..j-1)."""

    def __init__(self, max_positions: int = 16, prior_acceptance: float = 0.5, prior_strength: float = 2.0,
                 decay: float = 0.95, pooled_decay: float = 0.999):
        if not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions must be an int >= 1, got {max_positions!r}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance!r}")
        if not prior_strength > 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength!r}")
        for name, value in (("decay", decay), ("pooled_decay", pooled_decay)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        self.max_positions = max_positions
        self.prior_acceptance = prior_acceptance
        self.prior_strength = prior_strength
        self.decay, self.pooled_decay = decay, pooled_decay
        # counts[:, 0] successes, counts[:, 1] trials; row 0 = scalar, rows 1.. = positions
        self._pooled = np.zeros((max_positions + 1, 2))
        self._requests: dict[str, np.ndarray] = {}

    def update(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}")
        if num_drafted == 0:
            return
        outcome = np.zeros((self.max_positions + 1, 2))
        num_tried = min(num_accepted + 1, num_drafted)
        outcome[0] = (num_accepted, num_tried)
        positions = np.minimum(np.arange(num_tried), self.max_positions - 1) + 1  # deep ones share the last
        np.add.at(outcome[:, 1], positions, 1.0)
        np.add.at(outcome[:, 0], positions[:num_accepted], 1.0)
        counts = self._requests.get(request_id)
        self._requests[request_id] = outcome if counts is None else counts * self.decay + outcome
        self._pooled = self._pooled * self.pooled_decay + outcome

    def _pooled_posterior(self) -> np.ndarray:
        return (self._pooled[:, 0] + self.prior_strength * self.prior_acceptance) / (
            self._pooled[:, 1] + self.prior_strength)

    def _posterior(self, request_id: str) -> np.ndarray:
        pooled = self._pooled_posterior()
        counts = self._requests.get(request_id)
        if counts is None:
            return pooled
        return (counts[:, 0] + self.prior_strength * pooled) / (counts[:, 1] + self.prior_strength)

    def acceptance(self, request_id: str) -> float:
        """Per-token acceptance rate a under the i.i.d. model."""
        return float(self._posterior(request_id)[0])

    def position_acceptances(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B, max_positions] ``position_acceptance`` of many requests in one vectorised pass
        (request by request it was ~0.1 ms per batch-32 step, run every step)."""
        pooled = self._pooled_posterior()
        empty = np.zeros_like(self._pooled)
        counts = np.stack([self._requests.get(r, empty) for r in request_ids])  # [B, P + 1, 2]
        posterior = (counts[:, :, 0] + self.prior_strength * pooled) / (counts[:, :, 1] + self.prior_strength)
        return posterior[:, 1:]

    def position_acceptance(self, request_id: str) -> list[float]:
        """[max_positions] conditional acceptance of each draft position."""
        return self._posterior(request_id)[1:].tolist()

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


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
) -> list[int]:
    """Per-request K in 0..max_k maximising the batch's tokens per second.

    Objective for choices K_i over B decoding requests plus ``num_other_tokens`` (prefill
    chunks) in the same target pass:
        (sum_i E_i(K_i) + num_other_tokens) / (draft_time + target(sum_i (K_i + 1) + num_other_tokens))
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
    seconds = cost.costs("target", base_tokens + num_added) + np.concatenate([[0.0], np.cumsum(draft_delta)])
    throughput = value / np.maximum(seconds, 1e-30)
    best = int(np.flatnonzero(throughput >= throughput.max() * (1.0 - 1e-9))[0])
    return np.bincount(owner[:best], minlength=num_requests).tolist()


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


class ThroughputGuard:
    """The cost model's check against reality: realised tokens per second of whole steps
    (proposal, target, verification, commit) that speculated vs steps that did not, per
    batch-size bucket (decoding requests, rounded down to a power of two), as ratios of EMAs.

    The cost model prices forward passes only; what it misses (a proposer's host time, the
    verification path, acceptance that changed since it was estimated) can make "auto" lose to
    plain decoding by a few percent. So: when speculating steps have been slower than plain ones
    in this bucket, ``allow`` says no, except for a probe ``probe_every`` steps later (to notice
    when drafts start paying again), the gap doubling with each probe that confirms the loss, up to
    ``max_backoff`` x ``probe_every``; while speculation is allowed, every ``probe_every``-th step
    is plain (to keep that rate current), and until a bucket has a plain rate every other step is
    plain. Plain steps cost nothing against speculation off; the speculating probes bound the
    guard's cost at about 1 / probe_every of the difference between the two rates, falling as
    the loss persists."""

    def __init__(self, probe_every: int = 32, min_steps: int = 6, ema_rate: float = 0.1, margin: float = 0.0,
                 max_backoff: int = 8):
        if probe_every < 2 or min_steps < 1 or not 0.0 < ema_rate <= 1.0 or not 0.0 <= margin < 1.0 \
                or max_backoff < 1:
            raise ValueError(f"bad ThroughputGuard settings: probe_every={probe_every}, min_steps={min_steps}, "
                             f"ema_rate={ema_rate}, margin={margin}, max_backoff={max_backoff}")
        self.probe_every, self.min_steps, self.ema_rate, self.margin = probe_every, min_steps, ema_rate, margin
        self.max_backoff = max_backoff
        self._backoff: dict[int, tuple[int, int]] = {}  # bucket -> (step of the last probe, steps to the next)
        # bucket -> [steps seen, tokens EMA, seconds EMA, observations] per arm ("spec", "plain")
        self._arms: dict[int, dict[str, list[float]]] = {}
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(1, num_decoding).bit_length()

    def rate(self, num_decoding: int, arm: str) -> float | None:
        stats = self._arms.get(self.bucket(num_decoding), {}).get(arm)
        if stats is None or stats[2] < self.min_steps:
            return None
        return stats[0] / stats[1] if stats[1] > 0 else None

    def allow(self, num_decoding: int) -> bool:
        """Whether this step may speculate (the planner still chooses K per request)."""
        b = self.bucket(num_decoding)
        step = self._steps.get(b, 0)
        self._steps[b] = step + 1
        spec, plain = self.rate(num_decoding, "spec"), self.rate(num_decoding, "plain")
        if plain is None and step % 2 == 1:
            # learn the plain rate early: a plain step loses nothing against speculation off, and
            # with only the 1-in-probe_every probes a speculating bucket took ~200 steps to get it
            return False
        losing = spec is not None and plain is not None and spec < plain * (1.0 - self.margin)
        if not losing:
            self._backoff.pop(b, None)
            return step % self.probe_every != self.probe_every - 1
        # losing: a speculating probe now and then, ever rarer while it keeps confirming the loss
        # (measured: a batch-32 probe step cost 2.2x a plain one, three per 128-step run = -2.5%)
        last, interval = self._backoff.setdefault(b, (step, self.probe_every))
        if step - last < interval:
            return False
        self._backoff[b] = (step, min(2 * interval, self.max_backoff * self.probe_every))
        return True

    def requests_changed(self, num_decoding: int, new_fraction: float) -> None:
        """Part of the batch is new: the speculating rate is evidence about the requests that were
        there (their acceptance), so it keeps only the old share of its weight; the plain rate is
        the hardware's and stays. At batch 1 a new request starts with no speculating evidence (a
        chat answer that lost must not block the code answer after it: the default pair went 1.21x
        -> 1.05x), at batch 32 one new request barely moves it."""
        if new_fraction <= 0.0:
            return
        # the batch's mean acceptance moves with its new members' share, damped by the batch size:
        # a whole new batch of 32 requests of the same service behaves much like the last one
        # (forgetting 18% of it, 1/sqrt(32), cost ~3% at batch 32: re-learning steps at 2.2x a
        # plain step's cost), while at batch 1 the one request is everything
        forget = min(1.0, new_fraction / max(1, num_decoding))
        b = self.bucket(num_decoding)
        stats = self._arms.get(b, {}).get("spec")
        if stats is not None:
            stats[2] *= 1.0 - forget
        if forget >= 0.5:
            self._backoff.pop(b, None)

    def observe(self, num_decoding: int, speculated: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0.0 or tokens <= 0:
            return
        arms = self._arms.setdefault(self.bucket(num_decoding), {})
        stats = arms.setdefault("spec" if speculated else "plain", [0.0, 0.0, 0])
        rate = max(self.ema_rate, 1.0 / (stats[2] + 1))  # averages the first observations, then an EMA
        stats[0] += rate * (tokens - stats[0])
        stats[1] += rate * (seconds - stats[1])
        stats[2] += 1


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
