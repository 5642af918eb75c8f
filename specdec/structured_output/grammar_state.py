"""GrammarState: one request's committed grammar matcher; GrammarCursor: a private fork of it.

The committed matcher sits after the request's committed output and only ``commit`` moves
it. Every trial walk (a draft chain, each node of a token tree, the target's verification
rows) forks its own ``GrammarCursor`` from it and advances that, so no component has to put
a shared matcher back where it found it. A fork costs about one mask fill (a copy of the
matcher's stack), so a tree forks one cursor per node. Masks are xgrammar bitmasks (int32
words, bit j of row r set = token j allowed after row r's prefix). Once the grammar has
accepted its stop token the matcher is terminated and only the EOS tokens are allowed (a
request with ``ignore_eos`` goes on emitting EOS until its limit).
"""
from __future__ import annotations

import torch


class GrammarState:
    def __init__(self, compiled, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # after the committed output, nothing else
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]

    @staticmethod
    def allocate(num_rows: int, vocab_size: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, vocab_size)

    # ---- committed tokens ----
    def commit(self, tokens: list[int]) -> int:
        """Accept decided tokens for good; returns how many the grammar took (all, unless a
        caller bypassed the masks)."""
        for n, t in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return n
        return len(tokens)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def cursor(self) -> GrammarCursor:
        """A private matcher at the committed output."""
        return GrammarCursor(self.matcher.fork(), self.vocab_size, self.eos_token_ids)

    def path_cursors(self, paths: list[list[int]]) -> list[GrammarCursor]:
        """One cursor per path, each after the longest prefix of its path the grammar accepts.
        ``paths`` are a chain's or a tree's rows: [] or a path listed before it plus one token
        (any other path is walked from the committed output)."""
        cursors: dict[tuple[int, ...], GrammarCursor] = {}
        out = []
        for path in paths:
            key = tuple(path)
            parent = cursors.get(key[:-1]) if key else None
            if parent is not None:
                cur = parent.fork()
                if parent.num_accepted == len(key) - 1:
                    cur.advance(key[-1])
            else:
                cur = self.cursor()
                for t in key:
                    if not cur.advance(t):
                        break
            cursors.setdefault(key, cur)
            out.append(cur)
        return out

    def forced_token(self, scratch: torch.Tensor) -> int | None:
        """The one token the grammar allows after the committed output, if exactly one is
        (``scratch``: a 1-row bitmask)."""
        if self.matcher.is_terminated():
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


class GrammarCursor:
    """A forked matcher at the committed output plus ``num_accepted`` trial tokens; owned by
    whoever forked it, never shared."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: list[int], num_accepted: int = 0):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_accepted = num_accepted

    def advance(self, token: int) -> bool:
        """Accept ``token`` on trial; False (the cursor unmoved) if the grammar rejects it."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    def fork(self) -> GrammarCursor:
        return GrammarCursor(self.matcher.fork(), self.vocab_size, self.eos_token_ids, self.num_accepted)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed after this cursor's position."""
        if self.matcher.is_terminated():
            self.fill_eos(bitmask, row)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_eos(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row``: only the EOS tokens."""
        bitmask[row].zero_()
        for t in self.eos_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j


def end_dead_ends(bitmask: torch.Tensor, rows: list[int], cursors: list[GrammarCursor]) -> None:
    """Rows (filled by ``cursors[j].fill``) that allow no token get the EOS tokens: a grammar the
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
                cursors[start + j].fill_eos(bitmask, rows[start + j])
        start = end
