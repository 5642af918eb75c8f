"""ReasoningGrammarState: a request's grammar that starts where its reasoning ends.

A reasoning model writes its thinking first (``<think> ... </think>``); an output constraint
(a JSON schema, a tool-call grammar) is meant for the answer after it. The wrapper has
``GrammarState``'s interface and is a function of the tokens alone, so every mask the
worker asks for (a verification row after a drafted prefix, a draft model's row, a tree
node) is the one plain decoding would use at that position, and speculation stays lossless
across the switch:

- *reasoning*: every token is allowed, until the tokens of ``reasoning_end_token_ids`` have
  been generated in a row; the inner grammar starts right after them;
- *undecided* (``reasoning_start_token_id`` set, before the first token): the model may open
  its reasoning with that token or answer at once, so the inner grammar's tokens and that
  token are allowed; the first token decides;
- *answer*: the inner ``GrammarState`` alone.

``ReasoningGatedParams`` carries the token ids from the server to the worker with the
constraint; ``gated_state`` is the one call where a worker's grammar state is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.structured_output.grammar_state import GrammarState, _bit
from specdec.structured_output.params import StructuredOutputsParams

UNDECIDED, REASONING, ANSWER = "undecided", "reasoning", "answer"


@dataclass
class ReasoningGatedParams(StructuredOutputsParams):
    """A constraint applied from the end of the reasoning on (the grammar is the parent's)."""
    reasoning_end_token_ids: tuple[int, ...] = ()
    reasoning_start_token_id: int | None = None  # set: the output may open its reasoning with it; else it starts inside

    @classmethod
    def wrap(cls, params: StructuredOutputsParams, end_token_ids, start_token_id: int | None = None):
        if not end_token_ids:
            raise ValueError("ReasoningGatedParams.reasoning_end_token_ids must not be empty")
        base = {f.name: getattr(params, f.name) for f in dataclasses.fields(StructuredOutputsParams)}
        return cls(**base, reasoning_end_token_ids=tuple(end_token_ids), reasoning_start_token_id=start_token_id)


def gated_state(params: StructuredOutputsParams, state: GrammarState):
    """``state`` (the constraint's grammar), gated behind the reasoning when ``params`` says so."""
    if isinstance(params, ReasoningGatedParams):
        return ReasoningGrammarState(state, params.reasoning_end_token_ids, params.reasoning_start_token_id)
    return state


class ReasoningGrammarState:
    def __init__(self, inner: GrammarState, end_token_ids: tuple[int, ...], start_token_id: int | None = None):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.end_token_ids = tuple(end_token_ids)
        self.start_token_id = start_token_id
        # committed output: its phase, and its last tokens (a partial end sequence) while reasoning
        self.phase = UNDECIDED if start_token_id is not None else REASONING
        self.tail: tuple[int, ...] = ()
        self.path: list[int] = []  # trial tokens accepted on top of the committed output
        self.path_phase = self.phase

    allocate = staticmethod(GrammarState.allocate)

    def _advance(self, tokens: list[int]) -> tuple[str, tuple[int, ...], int | None]:
        """(phase, tail) after the committed output + ``tokens``, and the index of ``tokens`` at
        which the inner grammar starts (None while the answer has not begun)."""
        phase, tail, keep = self.phase, self.tail, len(self.end_token_ids) - 1
        if phase == ANSWER:
            return ANSWER, (), 0
        for i, t in enumerate(tokens):
            if phase == UNDECIDED:
                if t != self.start_token_id:
                    return ANSWER, (), i
                phase = REASONING
                continue
            tail = (*tail, t)
            if tail[-len(self.end_token_ids):] == self.end_token_ids:
                return ANSWER, (), i + 1
            tail = tail[len(tail) - keep:] if keep else ()
        return phase, tail, None

    # ---- committed tokens ----
    def commit(self, tokens: list[int]) -> int:
        self.goto([])
        phase, tail, start = self._advance(tokens)
        self.phase, self.tail = phase, tail
        self.path_phase = phase
        if start is None:
            return len(tokens)
        return start + self.inner.commit(tokens[start:])

    @property
    def is_terminated(self) -> bool:
        return self.phase == ANSWER and not self.path and self.inner.is_terminated

    # ---- trial paths ----
    def goto(self, path: list[int]) -> int:
        phase, _, start = self._advance(path)
        if start is None:
            self.inner.goto([])
            self.path, self.path_phase = list(path), phase
            return len(path)
        accepted = start + self.inner.goto(path[start:])
        self.path = list(path[:accepted])
        # a first token the undecided grammar refused leaves the position undecided
        self.path_phase = self.phase if accepted == 0 else ANSWER
        return accepted

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.path_phase == REASONING:
            bitmask[row].fill_(-1)  # every token
            return
        self.inner.fill(bitmask, row)
        if self.path_phase == UNDECIDED and self.start_token_id < self.vocab_size:
            bitmask[row, self.start_token_id // 32] |= _bit(self.start_token_id % 32)

    def fill_eos(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_eos(bitmask, row)

    def path_masks(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int = 0) -> list[int]:
        accepted = []
        for r, path in enumerate(paths):
            accepted.append(self.goto(path))
            self.fill(bitmask, first_row + r)
        self.goto([])
        return accepted

    def forced_token(self, scratch: torch.Tensor) -> int | None:
        if self.phase != ANSWER or self.path:
            return None
        return self.inner.forced_token(scratch)
