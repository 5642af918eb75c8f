"""The target's one forward per step: every scheduled request's rows in one ragged batch.

Request i feeds its scheduled tokens (a prefill chunk, or its newest token) and then its
drafts. Logits are wanted from the row before the first token the target must decide: a
chunk that completes the prompt, a decode row, or the K + 1 verification rows. A token
tree's node i sits in slot ``start + n + i`` but at position ``start + n - 1 + depth`` and
attends only to its ancestors (``AttentionMetadata.tree_masks``).
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.spec_decode import tree
from specdec.spec_decode.proposer import DraftProposal
from specdec.worker.model_runner import ForwardBatch, ModelRunner
from specdec.worker.request_state import CachedRequestState


@dataclass
class TargetInputs:
    batch: ForwardBatch
    verified: list[int]  # requests whose next token the target decides this step (indices into the batch)
    starts: list[int]  # per request: position of its first fed row
    row_offsets: list[int]  # per request: index of its first row in the flat batch


def prepare_target(runner: ModelRunner, reqs: list[CachedRequestState], num_scheduled: list[int],
                   proposal: DraftProposal, lora_slots: list[int] | None = None) -> TargetInputs:
    """``lora_slots``: per request, its adapter's slot (all its rows, drafts included, use it)."""
    feeds, starts, tables, logit_rows, verified = [], [], [], [], []
    tree_positions, tree_masks = [], []
    for i, (req, n, drafts) in enumerate(zip(reqs, num_scheduled, proposal.draft_token_ids)):
        start = req.num_computed_tokens
        feed = req.all_token_ids[start:start + n] + drafts
        completes = start + n == req.num_tokens
        feeds.append(feed)
        starts.append(start)
        tables.append(req.block_ids)
        logit_rows.append(list(range(n - 1, len(feed))) if completes else [])
        if completes:
            verified.append(i)
        positions, mask = None, None
        if proposal.is_tree and drafts:
            positions = list(range(start, start + n)) + [start + n - 1 + d for d in proposal.tree_depths[i]]
            mask = (start + n, tree.ancestor_mask(proposal.draft_parents[i], rows_before=n))
        tree_positions.append(positions)
        tree_masks.append(mask)
    group_tables = [req.group_block_ids for req in reqs] if runner.num_kv_groups > 1 else None
    batch = runner.prepare(feeds, starts, tables, logit_rows, tree_positions, tree_masks, lora_slots, group_tables)
    return TargetInputs(batch, verified, starts, batch.attn.query_start_loc_cpu[:-1])
