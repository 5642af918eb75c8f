"""Replay token-tree steps from graphs captured at a padded maximum shape.

A tree step's shape varies with the trees: each request feeds its own number of rows, and
each row has its own ancestor mask. `TreeGraph` captures, per batch size B, one graph over
static buffers sized for B requests of up to ``max_query_len`` rows each and tree masks of up
to ``max_tree_keys`` keys (``specdec.layers.tree_mask``). A step copies its rows in packed
(request after request, padding rows at the tail), its ragged ``query_start_loc`` and its
packed masks, and replays. What stays fixed at capture is only host metadata: the kernel's
tile sizes (from ``max_query_len``), its grid bound (from the buffer's rows) and its key
split (from the longest sequence a block table holds), none of which depends on how the
rows are shared out. So one graph serves any mix of tree, chain and decode requests that
fits, and needs the Triton attention kernel, which reads the ragged layout on the device.

Padding rows and padding requests are harmless: padding rows lie past ``query_start_loc[-1]``
(no attention output, KV write skipped by slot -1), padding requests own no rows. A hybrid model's
other KV cache groups read their own static tables and slots (``specdec.worker.graph_kv_groups``).
"""
from __future__ import annotations

import torch

from specdec.worker.graph_kv_groups import (group_graph_inputs, group_pad_values, group_static_inputs,
                                            max_table_width, with_window_views)
from specdec.worker.graph_runner import GraphRunner
from specdec.layers.attention import AttentionMetadata
from specdec.layers.tree_mask import PackedTreeMask, num_words_for


class TreeGraph:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 batch_sizes: list[int], max_query_len: int, max_tree_keys: int, max_blocks_per_seq: int,
                 use_graphs: bool | None = None, max_rows: int | None = None, group_windows: list | tuple = ()):
        """``group_windows``: the windows of the model's KV cache groups after the first."""
        if max_query_len < 1 or max_tree_keys < 1:
            raise ValueError(f"TreeGraph needs max_query_len >= 1 and max_tree_keys >= 1, got "
                             f"{max_query_len} and {max_tree_keys}")
        backend = getattr(model.layers[0].self_attn, "backend", None)
        if getattr(backend, "name", None) != "triton":
            # the torch paths read the host copy of query_start_loc, which a graph fixes at capture
            raise ValueError(f"tree graphs need attention_backend 'triton' (the model's is "
                             f"{getattr(backend, 'name', None)!r})")
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.max_query_len = max_query_len
        # rows of a batch size's buffers: every request at its maximum, or the most a step holds
        self.max_rows = max_rows
        self.num_words = num_words_for(max_tree_keys)
        self.max_blocks = max_blocks_per_seq
        self.group_windows = list(group_windows)
        self.runner = GraphRunner(self._forward, self._static_inputs, batch_sizes, device,
                                  pad_values={"slot_mapping": -1, "seq_lens": 1,
                                              **group_pad_values(self.group_windows)},
                                  use_graphs=use_graphs)
        self.runner.capture()

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step's rows, masks and block table fit a captured shape."""
        padded = self.runner.padded_size(meta.num_reqs)
        if padded is None or meta.max_query_len > self.max_query_len or max_table_width(meta) > self.max_blocks \
                or meta.query_start_loc_cpu[-1] > self._rows(padded):
            return False
        widths = [m[1].shape[1] for m in meta.tree_masks or () if m is not None]
        return num_words_for(max(widths, default=0)) <= self.num_words

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:  # [N, V] float32, a copy of the graph's rows
        padded = self.runner.padded_size(meta.num_reqs)
        tree = meta.packed_tree()
        if tree is None:  # every request causal: no tree keys anywhere
            tree = PackedTreeMask(meta.seq_lens, torch.zeros(len(input_ids), 1, dtype=torch.int32, device=self.device))
        qsl = meta.query_start_loc
        qsl = torch.cat([qsl, qsl[-1:].expand(padded - meta.num_reqs)])  # padding requests own no rows
        logits = self.runner.run(
            meta.num_reqs, num_output_rows=len(input_ids), input_ids=input_ids, positions=positions,
            slot_mapping=meta.slot_mapping, seq_lens=meta.seq_lens, block_tables=meta.block_tables,
            query_start_loc=qsl, tree_base=tree.base, tree_bits=tree.bits,
            **group_graph_inputs(meta, self.group_windows))
        return logits[logits_indices]

    def _rows(self, batch_size: int) -> int:
        rows = batch_size * self.max_query_len
        return rows if self.max_rows is None else min(rows, self.max_rows)

    def _static_inputs(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = self._rows(batch_size)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return {"input_ids": zeros(rows), "positions": zeros(rows), "slot_mapping": zeros(rows) - 1,
                "seq_lens": zeros(batch_size) + 1, "block_tables": zeros(batch_size, self.max_blocks),
                "query_start_loc": zeros(batch_size + 1), "tree_base": zeros(batch_size),
                "tree_bits": zeros(rows, self.num_words, dtype=torch.int32),
                **group_static_inputs(self.group_windows, batch_size, rows, self.max_blocks, self.device)}

    def _forward(self, input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc, tree_base,
                 tree_bits, **group_inputs) -> torch.Tensor:  # [rows, V]
        batch_size = seq_lens.shape[0]
        q = self.max_query_len
        attn = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
            slot_mapping=slot_mapping,
            # host view fixed at capture: the widest layout, the longest sequences a table holds
            query_start_loc_cpu=list(range(0, (batch_size + 1) * q, q)),
            seq_lens_cpu=[self.max_blocks * self.block_size] * batch_size, block_size=self.block_size,
            tree_packed=PackedTreeMask(tree_base, tree_bits))
        attn = with_window_views(attn, self.group_windows, group_inputs)
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, attn))

