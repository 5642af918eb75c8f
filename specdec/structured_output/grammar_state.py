"""GrammarState: one request's grammar matcher, its committed tokens and the masks it gives.

The matcher always sits at the committed output plus a draft ``path`` (tokens accepted on
trial); ``goto(path)`` rolls back to the longest common prefix and accepts the rest, so
walking a chain or a token tree in order costs about one accept per draft token. Masks are
xgrammar bitmasks (int32 words, bit j of row r set = token j allowed after row r's prefix).
Once the grammar has accepted its stop token the matcher is terminated and only the EOS
tokens are allowed (a request with ``ignore_eos`` goes on emitting EOS until its limit).
"""
from __future__ import annotations

import torch


class GrammarState:
    def __init__(self, compiled, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unlimited
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.path: list[int] = []  # trial tokens accepted on top of the committed output

    @staticmethod
    def allocate(num_rows: int, vocab_size: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, vocab_size)

    # ---- committed tokens ----
    def commit(self, tokens: list[int]) -> int:
        """Accept decided tokens for good; returns how many the grammar took (all, unless a
        caller bypassed the masks)."""
        self.goto([])
        for n, t in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return n
        return len(tokens)

    @property
    def is_terminated(self) -> bool:
        return not self.path and self.matcher.is_terminated()

    # ---- trial paths ----
    def goto(self, path: list[int]) -> int:
        """Put the matcher after committed + ``path``; returns how many of ``path`` it
        accepted (the matcher stays after that valid prefix)."""
        common = 0
        limit = min(len(path), len(self.path))
        while common < limit and path[common] == self.path[common]:
            common += 1
        if len(self.path) > common:
            self.matcher.rollback(len(self.path) - common)
            del self.path[common:]
        for t in path[common:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            self.path.append(t)
        return len(self.path)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed after the matcher's current position."""
        if self.matcher.is_terminated():
            self.fill_eos(bitmask, row)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_eos(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row``: only the EOS tokens."""
        bitmask[row].zero_()
        for t in self.eos_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)

    def path_masks(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int = 0) -> list[int]:
        """Fill rows first_row + r with the mask after ``paths[r]`` (each assumed valid, a
        parent's path before its children's); returns per path how many of its tokens the
        grammar accepted. Leaves the matcher at the committed output."""
        accepted = []
        for r, path in enumerate(paths):
            accepted.append(self.goto(path))
            self.fill(bitmask, first_row + r)
        self.goto([])
        return accepted

    def forced_token(self, scratch: torch.Tensor) -> int | None:
        """The one token the grammar allows next, if exactly one is (``scratch``: a 1-row bitmask)."""
        if self.path or self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(scratch, 0)
        words = scratch[0].nonzero()
        if len(words) != 1:
            return None
        word = int(words[0])
        bits = int(scratch[0, word]) & 0xFFFFFFFF
        if bits & (bits - 1):
            return None
        token = word * 32 + bits.bit_length() - 1
        return token if token < self.vocab_size else None


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j


def end_dead_ends(bitmask: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Rows (filled by ``states[j].fill``) that allow no token get the EOS tokens: a grammar the
    vocabulary cannot continue (a character no token spells: ``choice=["€"]`` with a tokenizer
    without it) then ends the request at its longest valid prefix, instead of emitting banned
    tokens (the argmax of an all -inf row) up to its length limit. numpy over runs of
    consecutive rows: a torch op per row would cost about what a fill does, and gathering
    the rows first three times the scan."""
    words = bitmask.numpy()
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1:
            end += 1
        live = words[rows[start]:rows[end - 1] + 1].any(axis=1)
        if not live.all():
            for j in (~live).nonzero()[0].tolist():
                states[start + j].fill_eos(bitmask, rows[start + j])
        start = end
