"""The KV cache budget of a worker: how many blocks each KV cache group's pool holds.

``kv_cache_memory`` bytes when set (any device); on a GPU otherwise what
``gpu_memory_utilization`` of the device leaves after what this process already holds (weights,
other engines), never more than is free (memory the caching allocator holds for no tensor counts
as free); on CPU otherwise 2 GiB or what ``max_num_seqs`` sequences need. Whatever the budget, one
max_model_len sequence must fit, counting for a sliding-window group only the blocks its window
keeps (``engine/kv_layout.py``; a sliding group holding a draft model's layers: all of them).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specdec.config import EngineConfig
from specdec.engine.kv_layout import KVGroup, KVLayout, group_blocks_per_sequence, split_kv_budget
from specdec.worker import device as device_info

DEFAULT_CPU_KV_BYTES = 2 << 30


def blocks_per_sequence(cfg: EngineConfig, max_model_len: int, max_k: int, window: int | None = None) -> int:
    """KV blocks one max_model_len sequence holds at once (its K speculative slots and the bonus
    token included), in a group whose layers read the last ``window`` positions (None: all)."""
    return group_blocks_per_sequence(window, max_model_len, max_k, cfg.max_num_batched_tokens, cfg.block_size)


def _budget(cfg: EngineConfig, device, bytes_per_sequence: int) -> tuple[int, str]:
    """(bytes for the KV cache, the setting that raises it)."""
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory, "raise kv_cache_memory"
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - held
        budget = device_info.kv_cache_bytes_from_gpu_utilization(cfg.gpu_memory_utilization, held, device,
                                                                 free_bytes=free)
        return budget, f"raise gpu_memory_utilization (now {cfg.gpu_memory_utilization}), set kv_cache_memory"
    return min(DEFAULT_CPU_KV_BYTES, cfg.max_num_seqs * bytes_per_sequence), "raise kv_cache_memory"


def num_kv_blocks(cfg: EngineConfig, device, bytes_per_block: int, max_model_len: int, max_k: int,
                  window: int | None = None) -> int:
    """KV blocks for an engine whose every layer reads one block table (``window``: every layer's)."""
    per_seq_blocks = blocks_per_sequence(cfg, max_model_len, max_k, window)
    budget, setting = _budget(cfg, device, per_seq_blocks * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < per_seq_blocks:
        raise ValueError(
            f"KV cache of {budget} bytes holds {num_blocks} blocks of {cfg.block_size} tokens; one sequence of "
            f"max_model_len={max_model_len} needs {per_seq_blocks}: {setting} or lower max_model_len"
        )
    return num_blocks


def kv_layout(cfg: EngineConfig, device, groups: tuple[KVGroup, ...], bytes_per_block: list[int],
              max_model_len: int, max_k: int) -> KVLayout:
    """Each group's pool; ``bytes_per_block``: per group, one block of every cache reading its table."""
    if len(groups) == 1:
        n = num_kv_blocks(cfg, device, bytes_per_block[0], max_model_len, max_k, groups[0].blocks_per_sequence_window)
        return KVLayout(cfg.block_size, (replace(groups[0], num_blocks=n, bytes_per_block=bytes_per_block[0]),))
    per_seq = [blocks_per_sequence(cfg, max_model_len, max_k, g.blocks_per_sequence_window) for g in groups]
    budget, setting = _budget(cfg, device, sum(n * b for n, b in zip(per_seq, bytes_per_block)))
    try:
        sized = split_kv_budget(budget, groups, bytes_per_block, per_seq, cfg.max_num_seqs, cfg.block_size)
    except ValueError as e:
        raise ValueError(f"{e}: {setting} or lower max_model_len") from None
    return KVLayout(cfg.block_size, sized)
