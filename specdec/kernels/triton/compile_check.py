"""Compile every kernel ahead of time for GPU targets this machine does not have.

The Triton interpreter runs kernels as numpy and accepts code the GPU compiler rejects (loop
variables that change type, unsupported ops) and cannot show codegen for a 64-wide
wavefront. Triton can lower a kernel to PTX/cubin or AMDGCN/hsaco for any target without
the hardware, so this runs each public wrapper on small CPU tensors, catches its launch
instead of running it, and compiles that exact specialisation for e.g. sm_90 and gfx942.

    python -m specdec.kernels.triton.compile_check            # default targets
    python -m specdec.kernels.triton.compile_check cuda:90 hip:gfx942 hip:gfx1100

Must run with TRITON_INTERPRET unset (kernels are defined at import).
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# H100/H200, A100, MI300X (CDNA3), MI250 (CDNA2), RDNA3 (gfx1100, wave32)
DEFAULT_TARGETS = ("cuda:90", "cuda:80", "hip:gfx942", "hip:gfx90a", "hip:gfx1100")
_OPTION_NAMES = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "waves_per_eu")
_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8", torch.int8: "i8",
}


def parse_target(text: str) -> GPUTarget:
    backend, arch = text.split(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)


class _CaughtLaunch(Exception):
    pass


def catch_launch(kernel, call: Callable[[], object]) -> tuple[dict, dict, dict]:
    """Run `call` until it launches `kernel` (other kernels' launches are skipped); return
    (signature, constexprs, options) of that launch."""
    caught = {}
    jit_class = type(kernel)
    real_run = jit_class.run

    def fake_run(self, *args, grid=None, warmup=False, **kwargs):
        if self is kernel:
            caught["args"], caught["kwargs"] = args, kwargs
            raise _CaughtLaunch

    jit_class.run = fake_run
    try:
        call()
    except _CaughtLaunch:
        pass
    finally:
        jit_class.run = real_run
    if "args" not in caught:
        raise RuntimeError(f"{kernel.fn.__name__} was not launched")
    values = dict(zip(kernel.arg_names, caught["args"]))
    options = {k: v for k, v in caught["kwargs"].items() if k in _OPTION_NAMES}
    values.update({k: v for k, v in caught["kwargs"].items() if k not in _OPTION_NAMES})
    constexpr_names = {kernel.arg_names[i] for i in kernel.constexprs}
    signature, constexprs = {}, {}
    for name in kernel.arg_names:
        value = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def launches() -> list[tuple[str, object, Callable[[], object]]]:
    """(label, kernel, call) for the specialisations the engine uses."""
    from specdec.kernels.triton import kv_cache, paged_attention, rejection_sampler, top_k_top_p

    def attention(q_lens, seq_lens, group, head_dim, dtype, splits, tree: bool = False):
        num_kv_heads, block_size = 2, 16
        max_blocks = max(s // block_size + 1 for s in seq_lens)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        # a tree request's nodes start at base = seq_len - q_len + 1; the bits' values do not matter here
        tree_args = {}
        if tree:
            words = max(1, -(-(max(q_lens) - 1 + 31) // 32))  # as tree_mask.num_words_for(the widest mask)
            tree_args = {"tree_base": torch.tensor([s - q + 1 for q, s in zip(q_lens, seq_lens)]),
                         "tree_bits": torch.zeros(qsl[-1], words, dtype=torch.int32)}
        tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int64)
        query = torch.zeros(qsl[-1], num_kv_heads * group, head_dim, dtype=dtype)
        cache = torch.zeros(2, max_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        return lambda: paged_attention.paged_attention_triton(
            query, cache, tables, torch.tensor(seq_lens), torch.tensor(qsl), 0.1, query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens), num_kv_splits=splits, **tree_args)

    def write_kv(dtype):
        key = torch.zeros(4, 8, 128, dtype=dtype)
        cache = torch.zeros(2, 4, 16, 8, 128, dtype=dtype)
        return lambda: kv_cache.write_kv_cache_triton(key, key, cache, torch.arange(4))

    def reject(greedy: bool, random: bool, with_q: bool):
        n, vocab = 3, 1000
        cu = torch.tensor([0, 1, 3])
        core = rejection_sampler.rejection_sample_core_triton
        return lambda: core(
            torch.zeros(n, dtype=torch.int64), cu, 2,
            target_argmax=torch.zeros(n + 2, dtype=torch.int64) if greedy else None,
            target_probs=torch.zeros(n + 2, vocab) if random else None,
            draft_probs=torch.zeros(n, vocab) if with_q else None,
            uniforms=torch.zeros(2, 2), exponential_noise=torch.ones(2, vocab),
            is_greedy=torch.zeros(2, dtype=torch.bool) if greedy and random else None)

    def topk(k: bool, p: bool):
        logits = torch.zeros(2, 1000)
        return lambda: top_k_top_p.apply_top_k_top_p_triton(
            logits, torch.ones(2, dtype=torch.int64) if k else None, torch.ones(2) if p else None)

    pa = paged_attention
    return [
        ("attention decode bf16 d128 gqa4", pa._paged_attention_kernel, attention([1, 1], [40, 9], 4, 128, torch.bfloat16, 1)),
        ("attention mixed bf16 d64 gqa1", pa._paged_attention_kernel, attention([30, 5, 1], [60, 9, 3], 1, 64, torch.bfloat16, 1)),
        ("attention split-kv fp16 d128", pa._paged_attention_kernel, attention([1], [300], 8, 128, torch.float16, 4)),
        ("attention fp32 (ieee dot)", pa._paged_attention_kernel, attention([4], [20], 2, 64, torch.float32, 1)),
        ("attention tree bf16 d128 gqa4", pa._paged_attention_kernel,
         attention([25, 1], [90, 9], 4, 128, torch.bfloat16, 2, tree=True)),
        ("attention tree bf16 d64 gqa1", pa._paged_attention_kernel,
         attention([7, 3, 1], [60, 20, 9], 1, 64, torch.bfloat16, 1, tree=True)),
        ("attention merge splits", pa._merge_splits_kernel, attention([1], [300], 8, 128, torch.bfloat16, 4)),
        ("kv write bf16", kv_cache._write_kv_cache_kernel, write_kv(torch.bfloat16)),
        ("rejection greedy", rejection_sampler._rejection_sample_kernel, reject(True, False, False)),
        ("rejection random q", rejection_sampler._rejection_sample_kernel, reject(False, True, True)),
        ("rejection mixed one-hot", rejection_sampler._rejection_sample_kernel, reject(True, True, False)),
        ("top-k top-p", top_k_top_p._top_k_top_p_kernel, topk(True, True)),
        ("top-p only", top_k_top_p._top_k_top_p_kernel, topk(False, True)),
    ]


def compile_all(targets=DEFAULT_TARGETS, verbose: bool = True) -> list[str]:
    """Compile every launch for every target; returns failure messages (empty = all compiled)."""
    failures = []
    for label, kernel, call in launches():
        signature, constexprs, options = catch_launch(kernel, call)
        for target_text in targets:
            target = parse_target(target_text)
            start = time.perf_counter()
            try:
                triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
                status = "ok"
            except Exception as e:  # report every failure, not just the first
                status = f"FAIL {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                failures.append(f"{label} @ {target_text}: {status}")
            if verbose:
                print(f"{label:34s} {target_text:12s} {status} ({time.perf_counter() - start:.1f}s)", flush=True)
    return failures


if __name__ == "__main__":
    failed = compile_all(tuple(sys.argv[1:]) or DEFAULT_TARGETS)
    sys.exit(1 if failed else 0)
