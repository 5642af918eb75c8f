"""Verifiers: turn the target's verification rows into each request's emitted tokens.

A chain of K drafts goes through the rejection sampler (``rejection_sampler.py``); a token
tree through the tree walk (``tree.py``). Both return a ``Verification``; the tree verifier
also moves the accepted path's KV (and the target hidden states a proposer reads) to the
consecutive positions the path now holds, which a chain never needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.layers.sampler import SamplingMetadata
from specdec.spec_decode import tree
from specdec.spec_decode.proposer import DraftProposal


@dataclass
class Verification:
    token_ids: list[list[int]]  # per verified request: accepted drafts, then the recovered or bonus token
    num_accepted: list[int]  # per verified request
    scored_rows: list[list[int]]  # per verified request and emitted token: the row (within the request) that scored it
    accepted_paths: list[list[int]] | None = None  # token trees: the accepted nodes, root to leaf


class ChainVerifier:
    def __init__(self, rejection_sample):
        self.rejection_sample = rejection_sample  # the torch reference or the Triton kernel

    def verify(self, logits: torch.Tensor, proposal: DraftProposal, verified: list[int],
               meta: SamplingMetadata) -> Verification:
        """logits [sum(K_r + 1), V] of the ``verified`` requests (indices into the proposal), penalties applied."""
        drafts = [proposal.draft_token_ids[i] for i in verified]
        draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=logits.device)
        # requests that are not verified (partial prefills) never carry drafts: q rows stay aligned
        tokens, num_accepted = self.rejection_sample(logits, draft_ids, [len(d) for d in drafts],
                                                     proposal.draft_probs, meta)
        accepted = num_accepted.tolist()
        emitted = [row[:a + 1] for row, a in zip(tokens.tolist(), accepted)]
        return Verification(emitted, accepted, [list(range(len(e))) for e in emitted])

    @staticmethod
    def verify_argmax(logits: torch.Tensor, proposal: DraftProposal, verified: list[int]) -> Verification:
        """``verify`` for requests that are all greedy and whose logits need no processing (no
        penalties, min_tokens, grammar): each row's argmax read back once and the drafts walked
        on the host; the rejection sampler's greedy rule (accept while the draft equals argmax
        p, then emit argmax p) without its per-step tensors."""
        argmax = logits.argmax(dim=-1).tolist()  # [sum(K_r + 1)]
        emitted, accepted, row = [], [], 0
        for i in verified:
            drafts = proposal.draft_token_ids[i]
            n = 0
            while n < len(drafts) and drafts[n] == argmax[row + n]:
                n += 1
            emitted.append(drafts[:n] + [argmax[row + n]])
            accepted.append(n)
            row += len(drafts) + 1
        return Verification(emitted, accepted, [list(range(n + 1)) for n in accepted])

    def move_accepted(self, runner, first_slots: list[int], block_ids: list[list[int]], first_rows: list[int],
                      verification: Verification, hidden: torch.Tensor | None,
                      group_block_ids: list[tuple[list[int], ...]] | None = None) -> None:
        """A chain's accepted drafts already sit at their positions."""


class TreeVerifier:
    def verify(self, logits: torch.Tensor, proposal: DraftProposal, verified: list[int],
               meta: SamplingMetadata) -> Verification:
        verdicts = tree.verify_trees(
            logits, [(proposal.draft_token_ids[i], proposal.draft_parents[i]) for i in verified], meta)
        return Verification([v.tokens for v in verdicts], [len(v.path) for v in verdicts],
                            [v.rows for v in verdicts], [v.path for v in verdicts])

    @torch.inference_mode()
    def move_accepted(self, runner, first_slots: list[int], block_ids: list[list[int]], first_rows: list[int],
                      verification: Verification, hidden: torch.Tensor | None,
                      group_block_ids: list[tuple[list[int], ...]] | None = None) -> None:
        """Per verified request: node i sat at position ``first_slots[r] + i`` (and target row
        ``first_rows[r] + i``); move the accepted path's nodes to consecutive positions from
        ``first_slots[r]`` (a path through the first child at every depth is already in place).
        ``group_block_ids``: per request, its blocks in the runner's other KV cache groups."""
        src_slots, dst_slots = [], []
        group_tables = group_block_ids or [()] * len(block_ids)
        group_slots = [([], []) for _ in range(len(group_tables[0]) if group_tables else 0)]
        for first, blocks, groups, row, path in zip(first_slots, block_ids, group_tables, first_rows,
                                                    verification.accepted_paths):
            moves = [(first + node, first + j) for j, node in enumerate(path) if node != j]
            if not moves:
                continue
            for tables, (src, dst) in zip((blocks, *groups), [(src_slots, dst_slots), *group_slots]):
                src.extend(runner.slot_of(tables, s) for s, _ in moves)
                dst.extend(runner.slot_of(tables, d) for _, d in moves)
            if hidden is not None:
                src = torch.tensor([row + node for node in path], device=hidden.device)
                hidden[row:row + len(path)] = hidden[src]
        runner.move_kv(src_slots, dst_slots, group_slots)
