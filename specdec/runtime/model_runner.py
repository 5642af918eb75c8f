"""ModelRunner: owns a model and its paged KV cache; turns ragged token runs into one forward.

Both the target and a draft model use one of these; they share block ids (the draft's
cache has the same number of blocks), so one block table serves both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.layers.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, rows of the flat batch whose logits are wanted


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return model_config.num_hidden_layers * 2 * block_size * kv_heads * head_dim * itemsize

    def prepare(
        self,
        token_ids: list[list[int]],  # per request: the tokens fed this pass
        start_positions: list[int],  # per request: position of its first fed token
        block_tables: list[list[int]],  # per request: its block ids
        logits_rows: list[list[int]],  # per request: indices (into its fed tokens) needing logits
    ) -> ForwardBatch:
        bs = self.block_size
        flat_ids, positions, slots, logits_idx, qsl, seq_lens = [], [], [], [], [0], []
        for ids, start, blocks, rows in zip(token_ids, start_positions, block_tables, logits_rows):
            base = len(flat_ids)
            flat_ids.extend(ids)
            for p in range(start, start + len(ids)):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            logits_idx.extend(base + r for r in rows)
            qsl.append(len(flat_ids))
            seq_lens.append(start + len(ids))
        width = max(len(b) for b in block_tables)
        table = [b + [0] * (width - len(b)) for b in block_tables]
        dev = self.device

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        attn = AttentionMetadata(
            query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(table), slot_mapping=t(slots),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=bs,
        )
        return ForwardBatch(t(flat_ids), t(positions), attn, t(logits_idx))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [N, V] float32
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        return self.model.compute_logits(hidden[batch.logits_indices])
