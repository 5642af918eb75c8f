"""Token-tree masks packed into bits, the form attention kernels and captured graphs read.

``AttentionMetadata.tree_masks`` gives, per request, ``(base, mask [q_len, seq_len - base])``.
Packed, the step's tree masks become two tensors: the first tree key of each request
(``base``; a causal request gets its ``seq_len``, so it has no tree keys) and, per flat query
row, one bit per tree key, aligned to the key's absolute position: key n's bit is bit
``n % 32`` of word ``n // 32 - base // 32``. The alignment lets a kernel's tile of 32k keys
read exactly k words per row, whatever the base. Every layer of a step reads the same packed
form, and a graph captures fixed-size buffers of it.

The rule both the reference and the kernels apply: query row t sees key n iff n is at or
before t's own slot (causal) and (n < base or its bit is set).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_PER_WORD = 32


@dataclass
class PackedTreeMask:
    base: torch.Tensor  # [num_reqs] int64, first tree key position (seq_len for a causal request)
    bits: torch.Tensor  # [num_tokens, num_words] int32, key n's bit: bit n % 32 of word n // 32 - base // 32


def num_words_for(num_tree_keys: int) -> int:
    """Words that hold a mask of this many keys at any alignment."""
    return max(1, -(-(num_tree_keys + BITS_PER_WORD - 1) // BITS_PER_WORD))


def pack_rows(mask: torch.Tensor, num_words: int, offset: int = 0) -> torch.Tensor:  # [q, W] bool -> [q, words] int32
    """Bit offset + c (of word (offset + c) // 32) of each row is ``mask[row, c]`` (two's
    complement for bit 31)."""
    rows, width = mask.shape
    if offset + width > num_words * BITS_PER_WORD:
        raise ValueError(f"a tree mask of {width} keys at bit {offset} does not fit {num_words} words of "
                         f"{BITS_PER_WORD} bits")
    padded = torch.zeros(rows, num_words * BITS_PER_WORD, dtype=torch.int64, device=mask.device)
    padded[:, offset:offset + width] = mask
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=mask.device) << torch.arange(
        BITS_PER_WORD, device=mask.device)
    words = (padded.view(rows, num_words, BITS_PER_WORD) * weights).sum(-1)  # [q, num_words] in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_rows(bits: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:  # [q, words] -> [q, width] bool
    shifts = torch.arange(BITS_PER_WORD, device=bits.device)
    flat = ((bits.to(torch.int64)[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)
    return flat[:, offset:offset + width].bool()


def pack_tree_masks(
    tree_masks: list,  # per request None or (base, mask [q_len, seq_len - base] bool)
    query_start_loc_cpu: list[int],  # [num_reqs + 1]
    seq_lens_cpu: list[int],  # [num_reqs]
    device: torch.device,
    num_words: int | None = None,  # None: the fewest that hold the widest mask
) -> PackedTreeMask:
    if len(tree_masks) != len(seq_lens_cpu):
        raise ValueError(f"tree_masks has {len(tree_masks)} entries for {len(seq_lens_cpu)} requests")
    widths = [0]
    for r, tree in enumerate(tree_masks):
        if tree is None:
            continue
        base, mask = tree
        q_len = query_start_loc_cpu[r + 1] - query_start_loc_cpu[r]
        if not 0 <= base <= seq_lens_cpu[r] or tuple(mask.shape) != (q_len, seq_lens_cpu[r] - base):
            raise ValueError(f"tree_masks[{r}]: base {base} and mask {tuple(mask.shape)} do not fit a request of "
                             f"{q_len} query rows and seq_len {seq_lens_cpu[r]} (want [q_len, seq_len - base])")
        widths.append(mask.shape[1])
    num_words = num_words_for(max(widths)) if num_words is None else num_words
    bits = torch.zeros(query_start_loc_cpu[-1], num_words, dtype=torch.int32, device=device)
    base = list(seq_lens_cpu)
    for r, tree in enumerate(tree_masks):
        if tree is not None:
            base[r] = tree[0]
            rows = slice(query_start_loc_cpu[r], query_start_loc_cpu[r + 1])
            bits[rows] = pack_rows(tree[1].to(device), num_words, tree[0] % BITS_PER_WORD)
    return PackedTreeMask(torch.tensor(base, dtype=torch.int64, device=device), bits)
