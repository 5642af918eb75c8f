"""Benchmark-only "replay" proposer: controlled acceptance.

It knows the target's own greedy continuation of each prompt (computed first, without
speculation, and registered with ``set_reference``) and proposes it, replacing each token
by a different random one with probability ``1 - acceptance``. Under greedy verification
a proposed token is then accepted exactly when it was not corrupted, so sweeping the
acceptance rate measures the engine's efficiency independent of any draft model.

Importing this module (``specdec.bench`` does) registers the method "replay"; its controls
(``Executor.control_proposer``): "set_references" [(prompt ids, continuation ids), ...] and
"set_acceptance" (a probability).
"""
from __future__ import annotations

import random

from specdec.spec_decode.methods import SpecMethod, register_method
from specdec.spec_decode.proposer import DraftProposal, Proposer


class ReplayProposer(Proposer):
    name = "replay"

    def __init__(self, acceptance: float, vocab_size: int, seed: int = 0):
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.references: dict[tuple[int, ...], list[int]] = {}

    def set_reference(self, prompt_token_ids: list[int], continuation: list[int]) -> None:
        self.references[tuple(prompt_token_ids)] = list(continuation)

    def _corrupt(self, token: int) -> int:
        if self.rng.random() < self.acceptance:
            return token
        other = self.rng.randrange(self.vocab_size - 1)
        return other if other < token else other + 1

    def propose(self, requests, num_spec: list[int], tree_budget=None, grammar=None, target=None) -> DraftProposal:
        drafts = []
        for req, k in zip(requests, num_spec):
            ref = self.references.get(tuple(req.prompt_token_ids))
            if not k or ref is None:
                drafts.append([])
                continue
            done = req.num_output_tokens
            # follow the reference only while the output still agrees with it
            if ref[:done] != req.output_token_ids:
                drafts.append([])
                continue
            drafts.append([self._corrupt(t) for t in ref[done:done + k]])
        return DraftProposal(drafts, None)


def _validate(spec) -> None:
    if not 0.0 <= spec.acceptance <= 1.0:
        raise ValueError(f"speculative_config.acceptance must be in [0, 1], got {spec.acceptance}")


def _build(spec, runner, vocab_size: int, parts) -> ReplayProposer:
    return ReplayProposer(spec.acceptance, vocab_size)


def _set_references(proposer: ReplayProposer, pairs) -> None:
    for prompt, continuation in pairs:
        proposer.set_reference(prompt, continuation)


def _set_acceptance(proposer: ReplayProposer, acceptance) -> None:
    if not isinstance(acceptance, (int, float)) or not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"replay acceptance must be in [0, 1], got {acceptance!r}")
    proposer.acceptance = float(acceptance)


REPLAY = register_method(SpecMethod("replay", _build, validate=_validate,
                                    controls={"set_references": _set_references, "set_acceptance": _set_acceptance}))
