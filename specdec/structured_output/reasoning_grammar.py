"""ReasoningGrammarState: a request's grammar that starts where its reasoning ends.

A reasoning model writes its thinking first (``<think> ... </think>``); an output constraint
(a JSON schema, a tool-call grammar) is meant for the answer after it. The wrapper has
``GrammarState``'s interface (its cursors ``GrammarCursor``'s) and is a function of the tokens
alone, so every mask the worker asks for (a verification row after a drafted prefix, a draft
model's row, a tree node) is the one plain decoding would use at that position, and speculation stays lossless
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

from specdec.structured_output.grammar_state import GrammarCursor, GrammarState, _bit
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
    """The committed state: the phase after the committed output, and the inner grammar, which
    only ever receives the answer's tokens."""

    def __init__(self, inner: GrammarState, end_token_ids: tuple[int, ...], start_token_id: int | None = None):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.end_token_ids = tuple(end_token_ids)
        self.start_token_id = start_token_id
        # committed output: its phase, and its last tokens (a partial end sequence) while reasoning
        self.phase = UNDECIDED if start_token_id is not None else REASONING
        self.tail: tuple[int, ...] = ()

    allocate = staticmethod(GrammarState.allocate)

    # ---- committed tokens ----
    def commit(self, tokens: list[int]) -> int:
        """Accept decided tokens for good; returns how many were taken."""
        cur = self.cursor()
        for n, t in enumerate(tokens):
            if not cur.advance(t):
                tokens = tokens[:n]
                break
        if cur.phase == ANSWER and self.phase != ANSWER:  # the answer began inside these tokens
            start = len(tokens) - cur.inner.num_accepted
            self.inner.commit(tokens[start:])
        elif cur.phase == ANSWER:
            self.inner.commit(tokens)
        self.phase, self.tail = cur.phase, cur.tail
        return len(tokens)

    @property
    def is_terminated(self) -> bool:
        return self.phase == ANSWER and self.inner.is_terminated

    # ---- trial paths ----
    def cursor(self) -> ReasoningCursor:
        """A private cursor at the committed output."""
        inner = self.inner.cursor() if self.phase == ANSWER else None
        return ReasoningCursor(self, self.phase, self.tail, inner)

    def path_cursors(self, paths: list[list[int]]) -> list[ReasoningCursor]:
        """One cursor per path, each after the longest prefix of its path that is accepted."""
        out = []
        for path in paths:
            cur = self.cursor()
            for t in path:
                if not cur.advance(t):
                    break
            out.append(cur)
        return out

    def forced_token(self, scratch: torch.Tensor) -> int | None:
        if self.phase != ANSWER:
            return None
        return self.inner.forced_token(scratch)


class ReasoningCursor:
    """A trial position: the phase and partial end sequence after the committed output plus
    ``num_accepted`` tokens, and from the answer on a cursor of the inner grammar."""

    def __init__(self, state: ReasoningGrammarState, phase: str, tail: tuple[int, ...], inner: GrammarCursor | None,
                 num_accepted: int = 0):
        self.state = state
        self.phase, self.tail, self.inner = phase, tail, inner
        self.num_accepted = num_accepted
        self.vocab_size = state.vocab_size
        self.eos_token_ids = state.eos_token_ids

    def advance(self, token: int) -> bool:
        """Accept ``token`` on trial; False (the cursor unmoved) if it is refused."""
        state = self.state
        if self.phase == ANSWER:
            ok = self.inner.advance(token)
        elif self.phase == UNDECIDED and token == state.start_token_id:
            self.phase, ok = REASONING, True
        elif self.phase == UNDECIDED:  # answering at once: the grammar from this token
            inner = state.inner.cursor()
            ok = inner.advance(token)
            if ok:
                self.phase, self.inner = ANSWER, inner
        else:
            ends = state.end_token_ids
            tail = (*self.tail, token)
            if tail[-len(ends):] == ends:
                self.phase, self.tail, self.inner = ANSWER, (), state.inner.cursor()
            else:
                keep = len(ends) - 1
                self.tail = tail[len(tail) - keep:] if keep else ()
            ok = True
        self.num_accepted += ok
        return ok

    def fork(self) -> ReasoningCursor:
        inner = self.inner.fork() if self.inner is not None else None
        return ReasoningCursor(self.state, self.phase, self.tail, inner, self.num_accepted)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row``: every token while reasoning; the grammar's tokens (and the opening token
        while undecided) otherwise."""
        if self.phase == REASONING:
            bitmask[row].fill_(-1)
            return
        (self.inner or self.state.inner.cursor()).fill(bitmask, row)
        start = self.state.start_token_id
        if self.phase == UNDECIDED and start < self.vocab_size:
            bitmask[row, start // 32] |= _bit(start % 32)

    def fill_eos(self, bitmask: torch.Tensor, row: int) -> None:
        (self.inner or self.state.inner.cursor()).fill_eos(bitmask, row)
