"""StepCostModel: measured forward-pass seconds as a function of the tokens in the pass, per
kind ("target", "draft"), piecewise-linear over token-count knots with EMA updates;
``calibrate`` times a callable at start-up (``calibrate_shapes``: verification-shaped passes,
batch x rows per request), ``observe`` refines it every step."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

KINDS = ("target", "draft")
DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def verification_shapes(batch_sizes: Sequence[int], max_rows: int) -> list[tuple[int, int]]:
    """(requests, rows per request) of the passes "auto" chooses between: every batch size with
    1 (decode) to ``max_rows`` (K + 1) rows per request."""
    return [(batch, rows) for batch in batch_sizes for rows in range(1, max_rows + 1)]


def shape_token_counts(shapes: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Knots for a model calibrated on ``shapes``: the default ones plus each shape's row total, so
    the planner reads those passes' measured cost, not an interpolation across a curve that bends
    (a mixture-of-experts target's cost follows the experts its rows touch, a concave function
    of the rows until every expert is read)."""
    return tuple(sorted(set(DEFAULT_TOKEN_COUNTS) | {batch * rows for batch, rows in shapes}))


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
    n-gram / suffix proposers).

    Priced per (requests, rows): one request's 8 rows and 8 requests' single rows share the
    knot of 8 tokens but not their cost (8 requests read 8 contexts' KV; the other pass reads
    one 8 times), and a server mixes both. So an observation that names its pass's
    ``num_requests`` also teaches that batch bucket (requests rounded down to a power of two) its
    ratio to the shared curve, per knot (hat weights, averaged then an EMA); a bucket's price is
    the shared curve times its ratios, interpolated between the knots it has seen and flat beyond
    them (1 with none seen). An engine serving one batch size reads the shared curve, scaled by a
    ratio near 1."""

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
        # (kind, batch bucket) -> [num_knots, 2]: observed / shared-curve seconds per knot, its mass
        self._ratios: dict[tuple[str, int], np.ndarray] = {}
        # kind or (kind, bucket) -> (knots, monotone values, slope beyond the last knot): what ``costs``
        # reads, rebuilt after a change (the planner asks many times per step, a step changes few knots)
        self._curves: dict[str | tuple[str, int], tuple[np.ndarray, np.ndarray, float]] = {}

    def has_observations(self, kind: str) -> bool:
        _validate_kind(kind)
        return bool(self._mass[kind].any())

    @staticmethod
    def bucket(num_requests: int) -> int:
        """The batch bucket of a pass over ``num_requests`` requests: 1, 2-3, 4-7, 8-15, ..."""
        return max(1, num_requests).bit_length()

    def _neighbours(self, num_tokens: float) -> tuple[int, int, float]:
        """(lower knot, upper knot, weight of the upper one) around ``num_tokens`` (within the knots)."""
        knots = self.token_counts
        hi = min(int(np.searchsorted(knots, num_tokens)), len(knots) - 1)
        lo = hi if knots[hi] == num_tokens else hi - 1
        return lo, hi, 1.0 if lo == hi else (num_tokens - knots[lo]) / (knots[hi] - knots[lo])

    def observe(self, kind: str, num_tokens: int, seconds: float, num_requests: int | None = None) -> None:
        """One pass of ``num_tokens`` rows took ``seconds``; ``num_requests`` (the requests the rows
        belong to) also teaches that batch bucket its ratio to the shared curve."""
        _validate_kind(kind)
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        knots, values, mass = self.token_counts, self._seconds[kind], self._mass[kind]
        if num_tokens > knots[-1]:  # fold into the last knot under the proportional assumption
            seconds, num_tokens = seconds * knots[-1] / num_tokens, knots[-1]
        num_tokens = max(num_tokens, knots[0])
        lo, hi, w_hi = self._neighbours(num_tokens)
        shared = self.cost(kind, num_tokens) if mass.any() else seconds
        if num_requests is not None and shared > 0.0:
            self._observe_ratio(kind, self.bucket(num_requests), lo, hi, w_hi, seconds / shared)
        residual = seconds - shared
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
        self._changed(kind)

    def _observe_ratio(self, kind: str, bucket: int, lo: int, hi: int, w_hi: float, ratio: float) -> None:
        ratios = self._ratios.setdefault((kind, bucket), np.zeros((len(self.token_counts), 2)))
        for knot, weight in ((lo, 1.0 - w_hi), (hi, w_hi)) if lo != hi else ((hi, 1.0),):
            if weight <= 0.0:
                continue
            value, mass = ratios[knot]
            step = 1.0 if mass == 0.0 else max(self.ema_rate, weight / (mass + weight)) * weight
            ratios[knot] = value + step * (ratio - value), mass + weight

    def _changed(self, kind: str) -> None:
        """Drop the cached curves of ``kind`` (its buckets' too: they scale the shared one)."""
        self._curves = {key: curve for key, curve in self._curves.items()
                        if (key if isinstance(key, str) else key[0]) != kind}

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
        self._changed(kind)

    def _knot_values(self, kind: str) -> np.ndarray:
        """Knot seconds, with knots known only from calibration rescaled by the observed /
        calibrated ratio of the nearest knots that real steps have since measured. Start-up
        calibration runs short contexts; real steps (long contexts, sampling) can cost twice
        as much, and a curve mixing updated and stale knots would say that going from an observed
        knot to a stale larger one is nearly free, so "auto" would speculate where it does not pay."""
        values, calibrated = self._seconds[kind], self._calibrated[kind]
        anchors = np.flatnonzero(self._observed[kind] & (calibrated > 0))
        stale = np.flatnonzero(~self._observed[kind] & (calibrated > 0))
        if anchors.size == 0 or stale.size == 0:
            return values
        values = values.copy()
        ratios = values[anchors] / calibrated[anchors]
        values[stale] = calibrated[stale] * np.interp(stale, anchors, ratios)  # flat beyond the ends
        return values

    def costs(self, kind: str, num_tokens: np.ndarray, num_requests: int | None = None) -> np.ndarray:
        """Vectorised ``cost``: num_tokens [N] -> seconds [N] (of a pass over ``num_requests``
        requests: its batch bucket's price, where that bucket has been observed)."""
        _validate_kind(kind)
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        observed = self._mass[kind] > 0
        if not observed.any():
            return np.where(num_tokens > 0, 1.0 if kind == "target" else 0.0, 0.0)
        key = kind if num_requests is None or (kind, self.bucket(num_requests)) not in self._ratios \
            else (kind, self.bucket(num_requests))
        curve = self._curves.get(key) or self._curve(key, observed)
        knots, values, slope = curve
        inside = np.interp(num_tokens, knots, values)
        beyond = values[-1] + slope * (num_tokens - knots[-1])
        return np.where(num_tokens <= 0, 0.0, np.where(num_tokens > knots[-1], beyond, inside))

    def _curve(self, key: str | tuple[str, int], observed: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """(knots, monotone values, slope beyond the last knot) of a kind's shared curve, or of a
        (kind, bucket): the shared curve's values times the bucket's ratios (which were measured
        against those values)."""
        if isinstance(key, str):
            knots, values = self.token_counts[observed], self._knot_values(key)[observed]
        else:
            knots, shared, _ = self._curves.get(key[0]) or self._curve(key[0], observed)
            ratios = self._ratios[key]
            seen = ratios[:, 1] > 0
            values = shared * np.interp(knots, self.token_counts[seen], ratios[seen, 0])
        # a pass over more tokens never costs less: knots fed by different step mixes (prefill
        # chunks, long and short contexts) can disagree, and a dip would read as free tokens
        values = np.maximum.accumulate(values)
        slope = max(0.0, (values[-1] - values[-2]) / (knots[-1] - knots[-2])) if knots.shape[0] > 1 else 0.0
        curve = self._curves[key] = (knots, values, slope)
        return curve

    def cost(self, kind: str, num_tokens: int, num_requests: int | None = None) -> float:
        return float(self.costs(kind, np.asarray([num_tokens]), num_requests)[0])

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

    def calibrate_shapes(
        self,
        run_fn: Callable[[int, int], float],
        shapes: Sequence[tuple[int, int]],
        kind: str = "target",
    ) -> dict[tuple[int, int], float]:
        """Seconds of ``run_fn(num_requests, rows_per_request)`` (a timed pass of that shape, e.g.
        ``worker.calibrate.time_verify_forward``) for each shape; each row total's knot takes the
        median over the shapes with that total (the model prices a pass by its rows, and B requests
        of q rows cost close to q requests of B when the rows route alike: the expert union of a
        mixture-of-experts layer depends on the rows, attention on short contexts is a small part).
        Every total must be a knot (``shape_token_counts``). Returns {(requests, rows): seconds}."""
        _validate_kind(kind)
        by_total: dict[int, list[float]] = {}
        measured = {}
        for batch, rows in shapes:
            if batch * rows not in self.token_counts:
                raise ValueError(f"shape ({batch} requests x {rows} rows): {batch * rows} rows is not a knot "
                                 f"of this model ({self.token_counts.tolist()}); build it with shape_token_counts")
            seconds = float(run_fn(batch, rows))
            measured[(batch, rows)] = seconds
            by_total.setdefault(batch * rows, []).append(seconds)
        for total, samples in by_total.items():
            self.set(kind, total, float(np.median(samples)))
        return measured
