"""ThroughputGuard: the check on reality behind adaptive K (realised tokens/s of speculating
and plain steps; backs off, probing now and then, when speculation stopped paying)."""
from __future__ import annotations


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
    is plain (to keep that rate current; every ``max_backoff`` x ``probe_every``-th while speculating
    is ahead by more than ``clear_win`` x beyond the noise), and until a bucket has a plain rate every
    other step is plain. Plain steps cost nothing against speculation off; the speculating probes bound the
    guard's cost at about 1 / probe_every of the difference between the two rates, falling as
    the loss persists.

    "Slower" means slower beyond the noise of the two rates (``z`` standard errors): at batch 1
    a speculating step's tokens vary from 1 to K + 1, so a few unlucky steps of a good draft can
    average below plain decoding. At large batches a step's tokens are a sum over its requests,
    the standard error is small and the guard stays sharp.

    A rate counts once its arm has ``min_steps`` steps, the plain one ``min_plain_steps``: a plain
    step's tokens are fixed (one per request) and its time varies little, so two fix that rate as
    well as six, and each plain step an engine takes to learn it gives up a speculating step's
    tokens (at batch 1, in the engine's first answer)."""

    def __init__(self, probe_every: int = 32, min_steps: int = 6, ema_rate: float = 0.1, margin: float = 0.0,
                 max_backoff: int = 8, z: float = 2.0, clear_win: float = 1.3, min_plain_steps: int = 2):
        if probe_every < 2 or min_steps < 1 or min_plain_steps < 1 or not 0.0 < ema_rate <= 1.0 \
                or not 0.0 <= margin < 1.0 or max_backoff < 1 or not z >= 0.0:
            raise ValueError(f"bad ThroughputGuard settings: probe_every={probe_every}, min_steps={min_steps}, "
                             f"min_plain_steps={min_plain_steps}, ema_rate={ema_rate}, margin={margin}, "
                             f"max_backoff={max_backoff}, z={z}")
        self.probe_every, self.min_steps, self.ema_rate, self.margin = probe_every, min_steps, ema_rate, margin
        self.min_plain_steps = min_plain_steps
        self.max_backoff, self.z, self.clear_win = max_backoff, z, clear_win
        self._backoff: dict[int, tuple[int, int]] = {}  # bucket -> (step of the last probe, steps to the next)
        # bucket -> per arm ("spec", "plain") EMAs [tokens, seconds, observations, tokens^2, seconds^2,
        # tokens x seconds]
        self._arms: dict[int, dict[str, list[float]]] = {}
        self._steps: dict[int, int] = {}
        self._clear_win: dict[int, bool] = {}  # bucket -> speculating was last seen far ahead

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(1, num_decoding).bit_length()

    def rate(self, num_decoding: int, arm: str) -> float | None:
        stats = self._arms.get(self.bucket(num_decoding), {}).get(arm)
        if stats is None or stats[2] < (self.min_plain_steps if arm == "plain" else self.min_steps):
            return None
        return stats[0] / stats[1] if stats[1] > 0 else None

    def _std_error(self, num_decoding: int, arm: str) -> float:
        """Standard error of ``rate`` (a ratio of means: the delta method on tokens - rate x seconds),
        over the EMA's effective number of steps."""
        tokens, seconds, n, tokens2, seconds2, cross = self._arms[self.bucket(num_decoding)][arm]
        rate = tokens / seconds
        variance = max(0.0, tokens2 - 2.0 * rate * cross + rate * rate * seconds2)
        effective = min(n, (2.0 - self.ema_rate) / self.ema_rate)
        return (variance / effective) ** 0.5 / seconds

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
        noise = 0.0 if spec is None or plain is None else self.z * (
            self._std_error(num_decoding, "spec") ** 2 + self._std_error(num_decoding, "plain") ** 2) ** 0.5
        losing = spec is not None and plain is not None and spec < plain * (1.0 - self.margin) - noise
        if losing:
            self._clear_win[b] = False
        else:
            self._backoff.pop(b, None)
            # far ahead (beyond the noise): the plain rate only needs checking now and then, and each
            # plain probe there gives up most of a speculating step's tokens. A bucket whose
            # speculating rate was just reset (new requests: see requests_changed) keeps the last
            # verdict until its new rate says otherwise: at batch 1 every request starts so, and
            # probing every probe_every steps until its rate is known gives up 1 / probe_every of the gain
            if spec is not None and plain is not None:
                self._clear_win[b] = spec - noise > plain * self.clear_win
            winning = self._clear_win.get(b, False)
            interval = self.probe_every * (self.max_backoff if winning else 1)
            return step % interval != interval - 1
        # losing: a speculating probe now and then, ever rarer while it keeps confirming the loss
        # (measured: a batch-32 probe step cost 2.2x a plain one, three per 128-step run = -2.5%)
        last, interval = self._backoff.setdefault(b, (step, self.probe_every))
        if step - last < interval:
            return False
        self._backoff[b] = (step, min(2 * interval, self.max_backoff * self.probe_every))
        return True

    def backing_off(self, num_decoding: int) -> bool:
        """Whether this bucket's speculating steps were last found slower than plain ones (``allow``
        then says no but for rare probes), as opposed to a plain step taken to keep that rate current."""
        return self.bucket(num_decoding) in self._backoff

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
        stats = arms.setdefault("spec" if speculated else "plain", [0.0, 0.0, 0, 0.0, 0.0, 0.0])
        rate = max(self.ema_rate, 1.0 / (stats[2] + 1))  # averages the first observations, then an EMA
        for i, value in ((0, tokens), (1, seconds), (3, tokens * tokens), (4, seconds * seconds), (5, tokens * seconds)):
            stats[i] += rate * (value - stats[i])
        stats[2] += 1
