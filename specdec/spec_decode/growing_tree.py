"""One request's token tree while a draft model grows it (EAGLE-2's expansion, used by
``DraftModelProposer`` with ``tree_topk`` > 1): every candidate with its path score (the sum of
the draft's log-probabilities along the path), which nodes were fed to the draft and where their
KV sits, and the final selection of the best nodes, closed under ancestors."""
from __future__ import annotations

import math
from functools import cached_property

import torch


class GrowingTree:
    """One request's tree while it is drafted: every candidate, scored; which ones were fed."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.fed: list[int] = []  # nodes in the order they were written to draft slots
        self.slot: dict[int, int] = {}  # node -> its draft slot (offset from base)
        self.row_of: dict[int, int] = {}  # node -> its row in the pass that fed it
        self.cursors: dict = {}  # node -> its grammar cursor (structured output; -1: the root)

    @property
    def num_fed(self) -> int:
        return len(self.fed)

    def add_children(self, parent: int, tokens: list[int], logprobs: list[float], depth: int) -> None:
        score = self.scores[parent] if parent >= 0 else 0.0
        for tok, lp in zip(tokens, logprobs):
            if lp == float("-inf"):
                continue
            self.tokens.append(tok)
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(score + lp)

    def cursor(self, node: int, grammar):
        """The grammar cursor after ``node``'s path, forked from its parent's on first use."""
        cur = self.cursors.get(node)
        if cur is None and node not in self.cursors:
            cur = self.cursors[node] = grammar.child(self.cursor(self.parents[node], grammar), self.tokens[node])
        return cur

    def frontier(self, depth: int, width: int) -> list[int]:
        """The ``width`` best-scoring nodes of ``depth`` (to be fed, to grow their children)."""
        nodes = [n for n, d in enumerate(self.depths) if d == depth]
        return sorted(nodes, key=lambda n: -self.scores[n])[:max(0, width)]

    def feed(self, nodes: list[int]) -> None:
        for n in nodes:
            self.slot[n] = len(self.fed)
            self.fed.append(n)

    def fed_mask(self, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), num_fed] bool: each fed node sees the slots of its ancestors and itself."""
        mask = torch.zeros(len(nodes), len(self.fed), dtype=torch.bool)
        for i, n in enumerate(nodes):
            while n >= 0:
                mask[i, self.slot[n]] = True
                n = self.parents[n]
        return mask

    @cached_property
    def ranked(self) -> list[int]:
        """Every node, best score first (read once the tree has stopped growing)."""
        return sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], self.depths[n]))

    def gains(self, limit: int) -> list[float]:
        """The draft's probability of each of the ``limit`` best nodes' paths, best first."""
        return [math.exp(self.scores[n]) for n in self.ranked[:limit]]

    def select(self, limit: int) -> tuple[list[int], list[int]]:
        """The ``limit`` best-scoring nodes, closed under ancestors, in (depth, score) order:
        (tokens, parents as indices into the selection)."""
        chosen: set[int] = set()
        for n in self.ranked:
            if len(chosen) >= limit:
                break
            if self.parents[n] < 0 or self.parents[n] in chosen:
                chosen.add(n)
        kept = sorted(chosen, key=lambda n: (self.depths[n], -self.scores[n]))
        index = {n: i for i, n in enumerate(kept)}
        return [self.tokens[n] for n in kept], [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in kept]
