"""A hybrid model's KV cache groups (``engine/kv_layout.py``) in captured graphs.

Every KV cache group has its own block tables and slots; a graph reads each from a static buffer
of its own, ``block_tables_<g>`` [batch, max_blocks] and ``slot_mapping_<g>`` [rows] for group
g >= 1 (group 0's are ``block_tables`` and ``slot_mapping``), filled every step from the step's
``AttentionMetadata.window_views``. Freed blocks behind a window are block id 0 in a table
(``group_block_table.NULL_BLOCK_ID``); no query reads their keys. Pad rows write no KV in any group.
"""
from __future__ import annotations

import dataclasses

import torch

from specdec.layers.attention import AttentionMetadata


def group_static_inputs(windows: list[int | None], batch_size: int, num_rows: int, max_blocks: int,
                        device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed block tables [batch_size, max_blocks] and empty slots [num_rows] (-1) of groups 1..."""
    inputs = {}
    for g in range(1, len(windows) + 1):
        inputs[f"block_tables_{g}"] = torch.zeros(batch_size, max_blocks, dtype=torch.int64, device=device)
        inputs[f"slot_mapping_{g}"] = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    return inputs


def group_pad_values(windows: list[int | None]) -> dict[str, int]:
    return {f"slot_mapping_{g}": -1 for g in range(1, len(windows) + 1)}  # pad rows write no KV in any group


def group_graph_inputs(meta: AttentionMetadata, windows: list[int | None]) -> dict[str, torch.Tensor]:
    """A step's block tables and slots of groups 1.. (``windows``: their windows), to fill the buffers."""
    inputs = {}
    for g, window in enumerate(windows, start=1):
        view = meta.window_views[window]
        inputs[f"block_tables_{g}"] = view.block_tables
        inputs[f"slot_mapping_{g}"] = view.slot_mapping
    return inputs


def with_window_views(attn: AttentionMetadata, windows: list[int | None],
                      group_inputs: dict[str, torch.Tensor]) -> AttentionMetadata:
    """``attn`` with each group's view over the graph's buffers of that group (no groups: itself)."""
    if windows:
        attn.window_views = {window: dataclasses.replace(attn, block_tables=group_inputs[f"block_tables_{g}"],
                                                         slot_mapping=group_inputs[f"slot_mapping_{g}"])
                             for g, window in enumerate(windows, start=1)}
    return attn


def max_table_width(meta: AttentionMetadata) -> int:
    """The widest block table of the step, over every KV cache group."""
    views = meta.window_views.values() if meta.window_views else ()
    return max([meta.block_tables.shape[1], *(v.block_tables.shape[1] for v in views)])
