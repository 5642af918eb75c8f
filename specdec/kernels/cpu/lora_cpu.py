"""The multi-adapter bf16 LoRA kernel (``csrc/lora_cpu.cpp``: ``lora_bf16_add_``) for CPUs with bf16 dot
products (avx512_bf16), built on first use (``cpp_build``), and its pure-torch reference.

One call adds every row's delta ``B[slot] (A[slot] x)`` to a linear's output, each row multiplied by its
own slot's adapters only (rows grouped by slot), a row's result the same whatever else is in the call.
Adapters are kept in bf16 pair layout (``woq_cpu.pack_bf16_pairs``), ranks padded to ``RANK_BLOCK``:

    a  [P * L * R, K]  part p's A of slot l in rows (p * L + l) * R ..
    b  [L * N, R]      slot l's B of every part (N = the parts' outputs, each a multiple of 16), pre-scaled

Where the kernel cannot run (another CPU, a failed build, ``SPECDEC_DISABLE_LORA_KERNEL=1``),
``lora_bf16_add_`` runs ``reference_lora_bf16_add_``: the same rounding points (x and A x to bf16,
float32 sums), summed in another order.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.kernels.cpu import cpp_build
from specdec.kernels.cpu.woq_cpu import pack_bf16_pairs, unpack_bf16_pairs

NEEDS = ("avx512f", "avx512bw", "avx512_bf16")
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
DISABLE_ENV = "SPECDEC_DISABLE_LORA_KERNEL"
RANK_BLOCK = 16  # ranks are padded to a multiple of this (one 16-output block of A x per part)
OUT_BLOCK = 16  # each part's outputs must be a multiple of this


@functools.lru_cache(maxsize=1)
def extension():
    """``torch.ops.specdec_lora`` once built and loaded, or None (after one warning saying why)."""
    return cpp_build.load_ops("specdec_lora", "lora_cpu.cpp", "specdec_lora", ["-O3", *FLAGS,
                              "-DSPECDEC_LIB=specdec_lora"], needs=NEEDS, what="the bf16 LoRA CPU kernel",
                              fallback="bf16 adapters use the pure-torch path", disable_env=DISABLE_ENV)


def kernel_possible() -> bool:
    """Whether this CPU has the flags the kernel needs (nothing is built to answer)."""
    return set(NEEDS) <= cpp_build.cpu_flags() and not cpp_build.disabled(DISABLE_ENV)


def available() -> bool:
    return kernel_possible() and extension() is not None


def padded_rank(rank: int) -> int:
    return -(-rank // RANK_BLOCK) * RANK_BLOCK


def pack_a(a: torch.Tensor, rank: int) -> torch.Tensor:
    """One part's A of one slot, float32 [r, K] (r <= rank), as the rows it fills in ``a``: bf16 [rank, K]
    in pair layout, rows past r zero."""
    padded = a.new_zeros(rank, a.shape[1])
    padded[:a.shape[0]] = a
    return pack_bf16_pairs(padded.to(torch.bfloat16))


def pack_b(b_parts: list[torch.Tensor], rank: int) -> torch.Tensor:
    """One slot's scaled B of every part, float32 [out_p, r] each (r <= rank), as the rows it fills in ``b``:
    bf16 [N, rank] in pair layout, columns past r zero."""
    padded = torch.cat([F.pad(b, (0, rank - b.shape[1])) for b in b_parts])
    return pack_bf16_pairs(padded.to(torch.bfloat16))


def lora_bf16_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   num_slots: int, part_sizes: list[int]) -> torch.Tensor:
    """``out`` [M, N] += each row's delta (module doc); x [M, K], row_slots [M] int64 (-1: no adapter).
    Returns ``out``."""
    ops = extension() if x.device.type == "cpu" and kernel_possible() else None
    if ops is None:
        return reference_lora_bf16_add_(out, x, a, b, row_slots, num_slots, part_sizes)
    if out.dtype == torch.float32 and out.is_contiguous():
        ops.lora_bf16_add_(out, x, a, b, row_slots, num_slots, part_sizes)
        return out
    delta = torch.zeros(out.shape, dtype=torch.float32)
    ops.lora_bf16_add_(delta, x, a, b, row_slots, num_slots, part_sizes)
    return out.add_(delta.to(out.dtype))


def reference_lora_bf16_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             row_slots: torch.Tensor, num_slots: int, part_sizes: list[int]) -> torch.Tensor:
    """``lora_bf16_add_`` row by row in torch: x rounded to bf16, ``xa = A x`` in float32 rounded to bf16,
    ``delta = B xa`` in float32, added to the row once."""
    num_parts, k, rank = len(part_sizes), a.shape[1], b.shape[1]
    a_full = unpack_bf16_pairs(a).float().view(num_parts, num_slots, rank, k)
    b_full = unpack_bf16_pairs(b).float().view(num_slots, -1, rank)
    xb = x.reshape(-1, k).to(torch.bfloat16).float()
    offsets = [sum(part_sizes[:p]) for p in range(num_parts + 1)]
    for m, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        xa = (a_full[:, slot] @ xb[m]).to(torch.bfloat16).float()  # [P, R]
        delta = torch.cat([b_full[slot, offsets[p]:offsets[p + 1]] @ xa[p] for p in range(num_parts)])
        out[m] += delta.to(out.dtype)
    return out
