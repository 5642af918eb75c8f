"""ModelRunner: owns a model and its paged KV cache; turns ragged token runs into one forward.

Both the target and a draft model use one of these; they share block ids (the draft's
cache has the same number of blocks), so one block table serves both.

On GPUs (Triton attention) ``enable_graphs`` captures CUDA/HIP graphs of the uniform steps —
every request feeding the same number of rows q: 1 for decode and for a draft's proposal
passes, K + 1 for verification — at a ladder of batch sizes; ``forward`` replays the smallest
graph that fits and runs everything else (prefill chunks, mixed steps, larger batches) eagerly.
``enable_tree_graphs`` adds graphs of token-tree steps at a padded maximum shape
(``specdec.worker.tree_graph``). A hybrid model's KV cache groups each get their own static block
table and slot buffers (``block_tables_<g>``, ``slot_mapping_<g>`` for group g >= 1), filled per step.
"""
from __future__ import annotations

import array
import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import torch

from specdec.engine.kv_layout import KVLayout
from specdec.layers.attention import AttentionMetadata
from specdec.layers.lora import LoRAMapping
from specdec.worker.graph_kv_groups import (group_graph_inputs, group_pad_values, group_static_inputs,
                                            max_table_width, with_window_views)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, rows of the flat batch whose logits are wanted
    features: torch.Tensor | None = None  # [T, H] target hidden states fed to an EAGLE head


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 reuse_logits: bool = False, aux_layers: tuple[int, ...] = (), kv_layout: KVLayout | None = None):
        """``kv_layout``: the KV cache groups (``engine/kv_layout.py``); a layer of a group other
        than the first has that group's pool and reads its block tables. None: one group of
        ``num_blocks``."""
        self.model = model
        # the target layers whose input an EAGLE-3 head reads; () costs nothing (the model collects none)
        self.aux_layers = tuple(aux_layers)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # a family with another cache layout (MLA's latent) declares its per-layer shape
        cache_shape = getattr(model, "kv_cache_shape", None)
        shape = cache_shape(num_blocks, block_size) if cache_shape is not None else \
            (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_groups = kv_layout.groups if kv_layout is not None else ()
        owner = kv_layout.layer_groups(len(model.layers)) if kv_layout is not None else [0] * len(model.layers)
        self.layer_kv_groups = owner  # the KV cache group of each layer
        self.kv_caches = [torch.zeros(shape if g == 0 else (shape[0], self.kv_groups[g].num_blocks, *shape[2:]),
                                      dtype=dtype, device=device) for g in owner]
        self.graphs: dict[int, object] = {}  # rows per request q -> GraphRunner (enable_graphs)
        self.graph_max_blocks = 0
        self.graph_feature_size = 0  # > 0: the graphs feed an EAGLE head's features [rows, H] (enable_graphs)
        self.tree_graph = None  # TreeGraph (enable_tree_graphs)
        # True for a runner whose logits are dead by its next forward (the target's: one per step):
        # they go to one grow-only float32 buffer instead of a fresh, page-faulted tensor each step.
        # Off where a caller keeps logits across forwards (the draft model's K passes).
        self.reuse_logits = reuse_logits
        self._logits_buf: torch.Tensor | None = None  # [rows, V] float32

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        token_shape = _family_kv_token_shape(model_config)  # (planes, heads, values) of one token and layer
        if token_shape is not None:
            return model_config.num_hidden_layers * block_size * math.prod(token_shape) * itemsize
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        return model_config.num_hidden_layers * 2 * block_size * kv_heads * head_dim * itemsize

    def prepare(
        self,
        token_ids: list[list[int]],  # per request: the tokens fed this pass
        start_positions: list[int],  # per request: position of its first fed token
        block_tables: list[list[int]],  # per request: its block ids
        logits_rows: list[list[int]],  # per request: indices (into its fed tokens) needing logits
        tree_positions: list[list[int] | None] | None = None,  # per request: its rows' own positions (token trees)
        tree_masks: list[tuple[int, torch.Tensor] | None] | None = None,  # see ``AttentionMetadata.tree_masks``
        lora_slots: list[int] | None = None,  # per request: its adapter slot (-1: base), see ``layers/lora.py``
        group_block_tables: list[tuple[list[int], ...]] | None = None,  # per request: the other KV groups' ids
    ) -> ForwardBatch:
        """Request i's tokens go to the slots of positions start_positions[i], +1, ...; they are
        also their positions unless ``tree_positions[i]`` gives others (a tree's nodes: depth)."""
        bs = self.block_size
        flat_ids, positions, slots, logits_idx, qsl, seq_lens = [], [], [], [], [0], []
        for i, (ids, start, blocks, rows) in enumerate(zip(token_ids, start_positions, block_tables, logits_rows)):
            base = len(flat_ids)
            end = start + len(ids)
            flat_ids.extend(ids)
            own = tree_positions[i] if tree_positions is not None else None
            positions.extend(own if own is not None else range(start, end))
            slots.extend([blocks[p // bs] * bs + p % bs for p in range(start, end)])  # slot_of, inlined
            logits_idx.extend([base + r for r in rows])
            qsl.append(len(flat_ids))
            seq_lens.append(end)
        num_reqs, width = len(block_tables), max(len(b) for b in block_tables)
        table = []
        for blocks in block_tables:
            table.extend(blocks)
            if len(blocks) < width:
                table.extend([0] * (width - len(blocks)))
        # every int64 input in one host list and one tensor (one copy to a device), split into views
        parts = (flat_ids, positions, slots, logits_idx, qsl, seq_lens, table)
        flat = int64_tensor(flat_ids + positions + slots + logits_idx + qsl + seq_lens + table, self.device)
        input_ids, positions_t, slot_mapping, logits_indices, qsl_t, seq_lens_t, table_t = \
            flat.split([len(part) for part in parts])
        dev = self.device
        attn = AttentionMetadata(
            query_start_loc=qsl_t, seq_lens=seq_lens_t, block_tables=table_t.view(num_reqs, width),
            slot_mapping=slot_mapping, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=bs,
            tree_masks=None if tree_masks is None or all(m is None for m in tree_masks) else
            [m if m is None else (m[0], m[1].to(dev)) for m in tree_masks],
            lora_mapping=None if lora_slots is None else LoRAMapping.build(lora_slots, qsl, dev),
        )
        if group_block_tables is None and self.num_kv_groups > 1:  # timing probes: blocks of each group's pool
            group_block_tables = [tuple([b % g.num_blocks for b in blocks] for g in self.kv_groups[1:])
                                  for blocks in block_tables]
        if group_block_tables is not None:
            attn.window_views = {self.kv_groups[g + 1].window: self._group_view(attn, [tables[g] for tables in
                                 group_block_tables], start_positions, token_ids) for g in range(len(self.kv_groups) - 1)}
        return ForwardBatch(input_ids, positions_t, attn, logits_indices)

    @property
    def num_kv_groups(self) -> int:
        return max(1, len(self.kv_groups))

    @property
    def group_windows(self) -> list[int | None]:
        """The windows of KV cache groups 1.. (the keys of ``AttentionMetadata.window_views``)."""
        return [g.window for g in self.kv_groups[1:]]

    def _group_view(self, attn: AttentionMetadata, block_tables: list[list[int]], start_positions: list[int],
                    token_ids: list[list[int]]) -> AttentionMetadata:
        """The step's metadata for the layers of another KV group: its block tables and slots."""
        slots = [self.slot_of(blocks, p) for blocks, start, ids in zip(block_tables, start_positions, token_ids)
                 for p in range(start, start + len(ids))]
        width = max(len(b) for b in block_tables)
        table = [b + [0] * (width - len(b)) for b in block_tables]
        dev = self.device
        return dataclasses.replace(attn, block_tables=torch.tensor(table, dtype=torch.int64, device=dev),
                                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [N, V] float32
        """Logits of the batch's ``logits_indices`` rows. With ``reuse_logits`` (the worker's target
        runner) they live in a buffer the next forward overwrites: clone what must outlive it."""
        return self.forward_with_hidden(batch, need_hidden=False)[0]

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch, need_hidden: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [N, V] float32 as ``forward``, the states a proposer reads of every fed row: the
        final hidden states [T, H], or with ``aux_layers`` those layers' inputs [T, n * H]). A
        replayed per-batch-size graph returns them too (views of its buffers, valid until its next
        replay); a tree graph returns logits only, so with ``need_hidden`` a tree step runs eagerly
        (without, the states are None)."""
        graph = self._graph_for(batch)
        if graph is not None and graph is self.tree_graph:
            if not need_hidden:
                return graph.run(batch.input_ids, batch.positions, batch.attn, batch.logits_indices), None
            graph = None
        if graph is not None:
            meta = batch.attn
            features = {"features": batch.features} if self.graph_feature_size else {}
            logits, exported = graph.run(meta.num_reqs, num_output_rows=len(batch.input_ids),
                                         input_ids=batch.input_ids, positions=batch.positions,
                                         slot_mapping=meta.slot_mapping, seq_lens=meta.seq_lens,
                                         block_tables=meta.block_tables, **features,
                                         **group_graph_inputs(meta, self.group_windows))
            return logits[batch.logits_indices], exported  # logits copied: the next replay reuses the buffer
        exported = None
        if batch.features is not None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, features=batch.features)
        elif self.aux_layers:
            hidden, exported = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn,
                                          aux_layers=self.aux_layers)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        # logits_indices rise strictly, so as many as there are rows means every row, in order
        rows = hidden if len(batch.logits_indices) == hidden.shape[0] else hidden[batch.logits_indices]
        exported = hidden if exported is None else exported
        if not self.reuse_logits:
            return self.model.compute_logits(rows), exported
        return self.model.compute_logits(rows, out=self._logits_out(rows.shape[0])), exported

    @torch.inference_mode()
    def move_kv(self, src_slots: list[int], dst_slots: list[int],
                group_slots: list[tuple[list[int], list[int]]] = ()) -> None:
        """Copy every layer's K/V from ``src_slots`` to ``dst_slots`` (a verified tree's accepted
        path, moved to the consecutive positions it now holds), the layers of another KV cache
        group by that group's (src, dst) slots in ``group_slots``. Reads all sources first."""
        if not src_slots:
            return

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        moves = [(t(src_slots), t(dst_slots))] + [(t(s), t(d)) for s, d in group_slots]
        owner = self.layer_kv_groups if group_slots else [0] * len(self.kv_caches)
        for cache, g in zip(self.kv_caches, owner):
            src, dst = moves[g]
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, dst] = flat[:, src]

    def slot_of(self, block_ids: list[int], position: int) -> int:
        """The cache slot of ``position`` in a request with blocks ``block_ids``."""
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _logits_out(self, num_rows: int) -> torch.Tensor:
        """[num_rows, V] float32 view of the reused buffer (grown, never shrunk)."""
        buf = self._logits_buf
        if buf is None or buf.shape[0] < num_rows:
            rows = num_rows if buf is None else max(num_rows, 2 * buf.shape[0])
            buf = self._logits_buf = torch.empty(rows, self.model.config.vocab_size, dtype=torch.float32,
                                                 device=self.device)
        return buf[:num_rows]

    # ---- graphs (GPU) ----

    @torch.inference_mode()
    def enable_graphs(self, batch_sizes: list[int], query_lens: list[int], max_blocks_per_seq: int,
                      use_graphs: bool | None = None, feature_size: int = 0) -> None:
        """Capture one GraphRunner per rows-per-request q, each at every batch size. The step's
        host metadata is fixed at capture: query lengths q, and sequence lengths taken as the
        longest a block table can hold, so the attention kernel's key split suits any context.
        ``use_graphs=False`` runs the same padded path eagerly (how CPU tests exercise it).
        ``feature_size`` H > 0: the model is an EAGLE head, fed ``ForwardBatch.features`` [rows, H]
        through a static buffer too (its passes after the first: one row per drafting request);
        a batch without features then runs eagerly."""
        from specdec.worker.graph_runner import GraphRunner

        self.graph_max_blocks = max_blocks_per_seq
        self.graph_feature_size = feature_size
        for q in sorted(set(query_lens)):
            runner = GraphRunner(
                partial(self._graph_forward, q), partial(self._static_inputs, q), batch_sizes, self.device,
                # pad rows write no KV (slot -1) and see q keys of block 0, so no row attends to nothing
                pad_values={"slot_mapping": -1, "seq_lens": q, **group_pad_values(self.group_windows)},
                use_graphs=use_graphs)
            runner.capture()
            self.graphs[q] = runner

    @torch.inference_mode()
    def enable_tree_graphs(self, batch_sizes: list[int], max_query_len: int, max_tree_keys: int,
                           max_blocks_per_seq: int, use_graphs: bool | None = None,
                           max_rows: int | None = None) -> None:
        """Capture tree steps of up to ``max_query_len`` rows and ``max_tree_keys`` tree keys per
        request, ``max_rows`` rows in all, at every batch size (``use_graphs=False``: the same
        padded path, eagerly)."""
        from specdec.worker.tree_graph import TreeGraph

        self.tree_graph = TreeGraph(self.model, self.kv_caches, self.block_size, self.device, batch_sizes,
                                    max_query_len, max_tree_keys, max_blocks_per_seq, use_graphs, max_rows,
                                    group_windows=self.group_windows)

    def _static_inputs(self, q: int, batch_size: int) -> dict[str, torch.Tensor]:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=self.device)

        inputs = {"input_ids": zeros(batch_size * q), "positions": zeros(batch_size * q),
                  "slot_mapping": zeros(batch_size * q) - 1, "seq_lens": zeros(batch_size) + q,
                  "block_tables": zeros(batch_size, self.graph_max_blocks)}
        if self.graph_feature_size:  # pad rows read zero features
            inputs["features"] = torch.zeros(batch_size * q, self.graph_feature_size, dtype=self.dtype,
                                             device=self.device)
        return {**inputs, **group_static_inputs(self.group_windows, batch_size, batch_size * q,
                                                self.graph_max_blocks, self.device)}

    def _graph_forward(self, q: int, input_ids, positions, slot_mapping, seq_lens, block_tables, features=None,
                       **group_inputs) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = seq_lens.shape[0]
        qsl = list(range(0, (batch_size + 1) * q, q))
        attn = with_window_views(AttentionMetadata(
            query_start_loc=torch.arange(0, (batch_size + 1) * q, q, device=self.device), seq_lens=seq_lens,
            block_tables=block_tables, slot_mapping=slot_mapping, query_start_loc_cpu=qsl,
            seq_lens_cpu=[self.graph_max_blocks * self.block_size] * batch_size, block_size=self.block_size),
            self.group_windows, group_inputs)
        if features is not None:
            hidden = exported = self.model(input_ids, positions, self.kv_caches, attn, features=features)
        elif self.aux_layers:
            hidden, exported = self.model(input_ids, positions, self.kv_caches, attn, aux_layers=self.aux_layers)
        else:
            hidden = exported = self.model(input_ids, positions, self.kv_caches, attn)
        return self.model.compute_logits(hidden), exported  # ([T, V], what a proposer reads [T, ...])

    def _graph_for(self, batch: ForwardBatch):
        meta = batch.attn
        if meta.tree_masks is not None:  # tree steps replay the padded tree graph, if it fits
            return self.tree_graph if self.tree_graph is not None and self.tree_graph.fits(meta) else None
        if not self.graphs or (batch.features is None) != (not self.graph_feature_size):
            return None
        graph = self.graphs.get(meta.uniform_query_len)
        if graph is None or graph.padded_size(meta.num_reqs) is None \
                or max_table_width(meta) > self.graph_max_blocks:
            return None
        return graph


def int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64, device=device)``, through an ``array`` (a C loop
    over the list instead of torch's per-element type checks: about 4x faster on hundreds of ids)."""
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else \
        torch.empty(0, dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)


def _family_kv_token_shape(model_config) -> tuple[int, ...] | None:
    """The registered family's own cache layout per token and layer (``kv_cache_token_shape``), or
    None for the per-head K and V layout (every family but those that declare one)."""
    from specdec.models.registry import MODEL_REGISTRY

    for arch in getattr(model_config, "architectures", None) or []:
        token_shape = getattr(MODEL_REGISTRY.get(arch), "kv_cache_token_shape", None)
        if token_shape is not None:
            return tuple(token_shape(model_config))
    return None
