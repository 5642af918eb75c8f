"""AcceptanceEstimator: per-request acceptance (scalar and per-position), Beta counts with
exponential forgetting, shrunk towards a pooled estimate over all requests."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class AcceptanceEstimator:
    """Per-request acceptance from (num_drafted, num_accepted) outcomes. Under the i.i.d.
    model a step that accepted A of K drafts is A successes plus one failure if A < K; the
    estimate is the Beta posterior mean with counts decayed by ``decay`` per update (memory
    ~ 1/(1 - decay) steps) and a prior of ``prior_strength`` pseudo-trials at the pooled
    estimate of all requests (itself starting at ``prior_acceptance``). Per position j the
    same counts give the conditional P(accept j | accepted 1..j-1).

    The pooled prior of position j > 1 is the pooled estimate of position j - 1, not the flat
    ``prior_acceptance``: a position that has rarely been tried is assumed to be accepted like
    the one before it. Under a flat prior a policy that drafts K = 2 never learns whether
    positions 3.. would pay, so it never drafts deeper.

    A step in which a request drafted nothing ages its counts too (``age``): its memory is
    counted in steps, not in drafting steps. Otherwise one rejected first draft of a new request
    (its estimate then sits below the pooled one, which can price every K above 0 out) is its
    last word: it plans K = 0, observes nothing, and decodes plainly to its end.

    The pooled evidence decays by ``pooled_decay`` per update while requests draft, and by
    ``pooled_idle_decay`` per step in which none did (``age_pooled``): the text being served can
    change while nothing is tried, so a belief that drafts fail, formed on a bad patch of text,
    grows uncertain again instead of being kept forever by a policy that stopped drafting
    (``optimistic_position_acceptance`` reads that uncertainty; the controller explores on it)."""

    def __init__(self, max_positions: int = 16, prior_acceptance: float = 0.5, prior_strength: float = 8.0,
                 decay: float = 0.95, pooled_decay: float = 0.999, pooled_idle_decay: float = 0.995):
        if not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions must be an int >= 1, got {max_positions!r}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance!r}")
        if not prior_strength > 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength!r}")
        for name, value in (("decay", decay), ("pooled_decay", pooled_decay), ("pooled_idle_decay", pooled_idle_decay)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        self.max_positions = max_positions
        self.prior_acceptance = prior_acceptance
        self.prior_strength = prior_strength
        self.decay, self.pooled_decay, self.pooled_idle_decay = decay, pooled_decay, pooled_idle_decay
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
        last = self.max_positions  # positions 1..: the deep ones share the last row
        outcome[1:min(num_tried, last) + 1, 1] = 1.0
        outcome[last, 1] += max(0, num_tried - last)
        outcome[1:min(num_accepted, last) + 1, 0] = 1.0
        outcome[last, 0] += max(0, num_accepted - last)
        counts = self._requests.get(request_id)
        self._requests[request_id] = outcome if counts is None else counts * self.decay + outcome
        self._pooled = self._pooled * self.pooled_decay + outcome

    def age(self, request_ids: Sequence[str]) -> None:
        """These requests drafted nothing this step: their own evidence decays by one step, so an
        estimate that stopped a request from drafting fades towards the pooled one."""
        for request_id in request_ids:
            counts = self._requests.get(request_id)
            if counts is not None:
                counts *= self.decay

    def age_pooled(self) -> None:
        """No request drafted this step: the pooled evidence decays by one idle step."""
        self._pooled *= self.pooled_idle_decay

    def _pooled_posterior(self) -> np.ndarray:
        successes, trials = self._pooled[:, 0], self._pooled[:, 1]
        posterior = np.empty(self.max_positions + 1)
        prior = self.prior_acceptance
        for row in range(self.max_positions + 1):  # row 0: scalar; rows 1..: positions, each the next's prior
            posterior[row] = (successes[row] + self.prior_strength * prior) / (trials[row] + self.prior_strength)
            prior = posterior[row] if row else self.prior_acceptance
        return posterior

    def _request_counts(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B, P + 1, 2] each request's decayed counts (zeros for one never seen)."""
        empty = np.zeros_like(self._pooled)
        return np.stack([self._requests.get(r, empty) for r in request_ids])

    def _scalar_posteriors(self, counts: np.ndarray, pooled_scalar: float) -> np.ndarray:
        """[B] each request's i.i.d. acceptance: its counts under a prior at the pooled estimate."""
        return (counts[:, 0, 0] + self.prior_strength * pooled_scalar) / (counts[:, 0, 1] + self.prior_strength)

    @property
    def num_pooled_trials(self) -> float:
        """Draft tokens tried over all requests (decayed): how much evidence the pooled estimate holds."""
        return float(self._pooled[0, 1])

    def acceptance(self, request_id: str) -> float:
        """Per-token acceptance rate a under the i.i.d. model."""
        pooled_scalar = self._pooled_posterior()[0]
        return float(self._scalar_posteriors(self._request_counts([request_id]), pooled_scalar)[0])

    def position_acceptances(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B, max_positions] ``position_acceptance`` of many requests in one vectorised pass
        (it runs every step, for the whole batch)."""
        pooled = self._pooled_posterior()
        scalar = self._scalar_posteriors(self._request_counts(request_ids), pooled[0])  # [B]
        return _shift_log_odds(pooled[1:], _log_odds(scalar) - _log_odds(pooled[0]))

    def position_acceptance(self, request_id: str) -> list[float]:
        """[max_positions] conditional acceptance of each draft position: the pooled profile over
        positions, shifted in log-odds by how much this request's own acceptance differs from the
        pooled one. A request's few recent steps fix one number well; per position they are too
        few (a position deep in the draft is tried only after every earlier one was accepted), and
        the planner, maximising over depths, picks whichever deep estimate noise made high."""
        return self.position_acceptances([request_id])[0].tolist()

    def unseen_position_acceptance(self) -> np.ndarray:
        """[max_positions] ``position_acceptance`` of a request with no evidence of its own: the
        pooled profile."""
        return self._pooled_posterior()[1:]

    def optimistic_position_acceptance(self, z: float) -> np.ndarray:
        """[max_positions] the pooled profile shifted up (in log-odds) until its first position
        sits ``z`` posterior standard deviations above its mean: the acceptance drafting could
        still have given what has been seen. Beta(s + n0 p, t - s + n0 (1 - p)) has variance
        m (1 - m) / (t + n0 + 1); with no evidence (t = 0, n0 = 8 pseudo-trials at 0.5) and
        z = 1.645 the bound is 0.77, after 10 rejections 0.38, after 30 0.19."""
        pooled = self._pooled_posterior()
        first = pooled[1]
        num_trials = self._pooled[1, 1] + self.prior_strength
        upper = min(1.0 - _EPS, first + z * (first * (1.0 - first) / (num_trials + 1.0)) ** 0.5)
        return _shift_log_odds(pooled[1:], np.array([_log_odds(upper) - _log_odds(first)]))[0]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


_EPS = 1e-6


def _log_odds(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _shift_log_odds(profile: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """[B, P]: sigmoid(logit(profile[P]) + shift[B])."""
    return 1.0 / (1.0 + np.exp(-(_log_odds(profile)[None, :] + shift[:, None])))
