"""Batched multi-adapter LoRA over the model's fused linears (a module transform).

``apply_lora(model, ...)`` wraps each layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` (whatever they are after quantization or tensor parallelism: the delta is added
to their output) in a ``LoRALinear`` holding stacked A / B weights for ``max_loras`` slots. A
fused linear's parts (q / k / v, gate / up) each have their own A and fill their own output
range:

    out[:, part] = base(x)[:, part] + (x A_part[slot]^T) B_part[slot]^T    (B pre-scaled)

Which slot each row uses is a model input: ``AttentionMetadata.lora_mapping`` (a
``LoRAMapping``, -1 = the base model). The transform's forward pre-hook hands that step's
mapping to the layers for the duration of the forward, so a model call without one (a draft
pass, a calibration) runs the base model. Rows of one adapter go through one matmul pair
(grouped by slot), never a merge per request.

On a CPU whose base linear streams bf16 weights in pair layout (``Bf16WeightLinear``, what
``dtype="auto"`` builds) and that has bf16 dot products, the adapters are kept the same way (bf16,
pair layout, half the bytes of float32 adapters, which a decode step streams whole) and each call
adds the whole batch's delta in one kernel call (``kernels/cpu/lora_cpu``): rows grouped by slot,
each multiplied by its own slot's A and B only, so a step reads the adapters present in it and no
zeros; a row's delta is the same alone and in any batch (speculative verification equals plain
decoding).

Tensor parallelism: a column-parallel linear keeps every A whole and this rank's rows of B; a
row-parallel one (``o_proj``, ``down_proj``) keeps this rank's input columns of A, so ``x A^T``
is a partial sum, all-reduced ([T, r]: small) before B.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdec.lora.adapter import TARGET_MODULES

# fused linear -> its PEFT parts in output order, and whether its input is sharded under TP
_FUSED = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), False), "o_proj": (("o_proj",), True),
          "gate_up_proj": (("gate_proj", "up_proj"), False), "down_proj": (("down_proj",), True)}
_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
# PEFT part -> the ``_Split.rows`` kind of its sharded dimension
_SPLIT_KIND = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "q", "gate_proj": "mlp", "up_proj": "mlp",
               "down_proj": "mlp"}
NO_ADAPTER = -1
# rows x (slots x parts x rank) up to which a step takes the masked all-slots path (two matmuls)
# instead of one matmul pair per adapter: its extra multiply-adds by zero stay below this bound
DENSE_MAX_ELEMENTS = 1 << 14


@dataclass
class LoRAMapping:
    """Which adapter slot each row of a step's flat batch uses."""
    row_slots: torch.Tensor  # [T] int64, slot of each row (-1: base)
    _host_slots: list[int] | None = field(default=None, repr=False)  # row_slots as a host list
    _groups: list | None = field(default=None, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)  # (slots, width, dtype) -> mask, shared by layers

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, its rows [n] int64, or None when it owns every row), one entry per slot in use, in slot
        order; made on first use (the bf16 kernel groups the rows itself) and shared by the layers."""
        if self._groups is None:
            slots = self._host_slots if self._host_slots is not None else self.row_slots.tolist()
            rows_of: dict[int, list[int]] = {}
            for row, slot in enumerate(slots):
                if slot != NO_ADAPTER:
                    rows_of.setdefault(slot, []).append(row)
            device = self.row_slots.device
            self._groups = [(slot, None if len(rows) == len(slots) else torch.tensor(rows, device=device))
                            for slot, rows in sorted(rows_of.items())]
        return self._groups

    def slot_mask(self, num_parts: int, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, num_parts * num_slots * rank]: 1 where the column (part-major, then slot, then rank)
        belongs to the row's slot; base rows get none."""
        key = (num_parts, num_slots, rank, dtype)
        if key not in self._masks:
            column_slot = torch.arange(num_slots, device=self.row_slots.device).repeat_interleave(rank)
            self._masks[key] = (self.row_slots[:, None] == column_slot.repeat(num_parts)[None, :]).to(dtype)
        return self._masks[key]

    @classmethod
    def build(cls, request_slots: list[int], query_start_loc: list[int], device) -> LoRAMapping | None:
        """From each request's slot and the batch's cumulative row counts; None if no row adapts."""
        if all(s == NO_ADAPTER for s in request_slots):
            return None
        rows: list[int] = []
        for slot, start, end in zip(request_slots, query_start_loc, query_start_loc[1:]):
            rows.extend([slot] * (end - start))
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), rows)


class LoRAContext:
    """The mapping of the forward in flight, shared by one model's ``LoRALinear`` layers. Set
    by the model's forward pre-hook from its metadata argument and cleared after the forward."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """A linear plus per-row adapters. Storage, part-major (P parts, L slots, R = max rank, ranks
    below it zero-padded): ``lora_a`` [P * L * R, in] holds part p's A for slot l in rows
    ``(p * L + l) * R + j``; ``lora_bt[p]`` [L * R, out_p] holds its B transposed in rows
    ``l * R + j``. One matmul gives every slot's ``x A^T``; masking each row to its own slot's
    columns and multiplying by each part's ``lora_bt`` gives the whole batch's delta. With ``bf16``
    (module doc) bf16 copies in ``kernels/cpu/lora_cpu``'s layout, ``a_pairs`` and ``b_pairs``, serve
    every forward instead, one kernel call per step."""

    def __init__(self, base: nn.Module, parts: tuple[str, ...], out_ranges: list[tuple[int, int]],
                 in_range: tuple[int, int], max_loras: int, max_rank: int, context: LoRAContext,
                 dtype: torch.dtype, device, tp=None):
        """``out_ranges``: per part, the rows of its (unsharded) B this rank keeps; ``in_range``:
        the columns of A it keeps; ``tp``: the group to all-reduce ``x A^T`` over (row-parallel)."""
        super().__init__()
        self.base = base
        self.parts = parts
        self.out_ranges = out_ranges
        self.in_range = in_range
        sizes = [end - start for start, end in out_ranges]
        self.out_offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # local output range of each part
        self.part_sizes = sizes
        self.context = context
        self.tp = tp
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * max_rank  # columns of x A^T per part
        self.part_width = width
        self.register_buffer("lora_a", torch.zeros(len(parts) * width, in_range[1] - in_range[0], dtype=dtype,
                                                   device=device), persistent=False)  # [P * L * R, in]
        for p, size in enumerate(sizes):  # [L * R, out_p] each
            self.register_buffer(f"lora_bt{p}", torch.zeros(width, size, dtype=dtype, device=device), persistent=False)
        self.slot_ranks = [0] * max_loras  # the largest rank loaded per slot (0: empty)
        # bf16 pair-layout copies for the bf16 kernel (``_bf16_fits``), updated slot by slot in set_slot
        self.bf16 = tp is None and _bf16_fits(base, in_range[1] - in_range[0], sizes)
        self.add_delta = None  # the kernel's op, called once per forward
        if self.bf16:
            from specdec.kernels.cpu import lora_cpu

            rank = lora_cpu.padded_rank(max_rank)
            self.register_buffer("a_pairs", torch.zeros(len(parts) * max_loras * rank, in_range[1] - in_range[0],
                                                        dtype=torch.bfloat16, device=device), persistent=False)
            self.register_buffer("b_pairs", torch.zeros(max_loras * sum(sizes), rank, dtype=torch.bfloat16,
                                                        device=device), persistent=False)
            self.add_delta = lora_cpu.extension().lora_bf16_add_.default

    @property
    def lora_bt(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_bt{p}") for p in range(len(self.parts))]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` from {part: (A [r, in], scaled B [out, r])}; parts absent stay zero."""
        rank, first = 0, slot * self.max_rank
        for p, part in enumerate(self.parts):
            row = p * self.part_width + first
            self.lora_a[row:row + self.max_rank].zero_()
            self.lora_bt[p][first:first + self.max_rank].zero_()
            if part not in weights:
                continue
            a, b = weights[part]
            r = a.shape[0]
            start, end = self.out_ranges[p]
            self.lora_a[row:row + r].copy_(a[:, self.in_range[0]:self.in_range[1]])
            self.lora_bt[p][first:first + r].copy_(b[start:end].T)
            rank = max(rank, r)
        self.slot_ranks[slot] = rank
        if self.bf16:
            self._pack_slot(slot)

    def _pack_slot(self, slot: int) -> None:
        """Copy ``slot``'s A and B into the bf16 pair-layout buffers (``kernels/cpu/lora_cpu``'s layout)."""
        from specdec.kernels.cpu import lora_cpu

        rank, first, num_parts = self.b_pairs.shape[1], slot * self.max_rank, len(self.parts)
        for p in range(num_parts):
            row = (p * self.max_loras + slot) * rank
            a = self.lora_a[p * self.part_width + first:p * self.part_width + first + self.max_rank]
            self.a_pairs[row:row + rank].copy_(lora_cpu.pack_a(a, rank))
        n = self.out_offsets[-1]
        b_parts = [bt[first:first + self.max_rank].T for bt in self.lora_bt]
        self.b_pairs[slot * n:(slot + 1) * n].copy_(lora_cpu.pack_b(b_parts, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        out = self.base(x)
        mapping = self.context.mapping
        if mapping is None:
            return out
        if self.add_delta is not None:
            if out.dtype != torch.float32 or not out.is_contiguous():
                return self._add_delta_widened(out, x, mapping)
            self.add_delta(out, x, self.a_pairs, self.b_pairs, mapping.row_slots, self.max_loras, self.part_sizes)
            return out
        if x.shape[0] * self.lora_a.shape[0] <= DENSE_MAX_ELEMENTS:
            # a small step (decode, verification): every slot's columns, each row masked to its own
            # slot: a few ops whatever the number of adapters (per-op cost dominates here)
            xa = torch.mm(x.to(self.lora_a.dtype), self.lora_a.T)  # [T, P * L * R]
            if self.tp is not None:
                xa = self.tp.all_reduce(xa)
            xa.mul_(mapping.slot_mask(len(self.parts), self.max_loras, self.max_rank, xa.dtype))
            if len(self.parts) == 1:
                return out.addmm_(xa.to(out.dtype), self.lora_bt[0].to(out.dtype))
            w = self.part_width
            for p, bt in enumerate(self.lora_bt):
                lo, hi = self.out_offsets[p], self.out_offsets[p + 1]
                out[:, lo:hi].addmm_(xa[:, p * w:(p + 1) * w].to(out.dtype), bt.to(out.dtype))
            return out
        for slot, rows in mapping.groups:  # a large step: each adapter's rows alone, exact work
            if self.slot_ranks[slot] == 0:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = self.slot_delta(xs, slot).to(out.dtype)
            if rows is None:
                out += delta
            else:
                out.index_add_(0, rows, delta)
        return out

    def _add_delta_widened(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """The bf16 kernel's delta into an output it cannot write in place (not contiguous float32)."""
        delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        self.add_delta(delta, x, self.a_pairs, self.b_pairs, mapping.row_slots, self.max_loras, self.part_sizes)
        return out.add_(delta.to(out.dtype))

    def slot_delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:  # x [n, in] -> [n, out]
        first, r, num_parts = slot * self.max_rank, self.max_rank, len(self.parts)
        a = self.lora_a.view(num_parts, self.max_loras, r, -1)[:, slot].reshape(num_parts * r, -1)  # [P * R, in]
        xa = torch.mm(x.to(a.dtype), a.T)  # [n, P * R]
        if self.tp is not None:
            xa = self.tp.all_reduce(xa)
        return torch.cat([xa[:, p * r:(p + 1) * r] @ bt[first:first + r] for p, bt in enumerate(self.lora_bt)],
                         dim=1)


def _bf16_fits(base: nn.Module, in_features: int, out_sizes: list[int]) -> bool:
    """Whether the adapters go bf16 (see the module doc): the base is a pair-layout bf16 linear, the bf16
    LoRA kernel runs here and takes the shapes (inputs even, every part's outputs a multiple of 16)."""
    from specdec.kernels.cpu import lora_cpu
    from specdec.layers.quantization import Bf16WeightLinear

    if not (isinstance(base, Bf16WeightLinear) and base.pairs and lora_cpu.kernel_possible()):
        return False
    if in_features % 2 or any(size % lora_cpu.OUT_BLOCK for size in out_sizes):
        return False
    return lora_cpu.available()


def lora_reference(x: torch.Tensor, row_slots: list[int], slot_weights: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
                   ) -> torch.Tensor:
    """The delta row by row (what ``LoRALinear`` computes batched): row i adds, per part p,
    ``B_p (A_p x_i)`` of its slot's [(A_p [r, in], scaled B_p [out_p, r])], parts concatenated."""
    rows = []
    for i, slot in enumerate(row_slots):
        if slot == NO_ADAPTER:
            width = sum(b.shape[0] for _, b in next(iter(slot_weights.values())))
            rows.append(torch.zeros(width, dtype=x.dtype))
            continue
        rows.append(torch.cat([b @ (a @ x[i]) for a, b in slot_weights[slot]]))
    return torch.stack(rows)


@dataclass
class LoRALayers:
    """What ``apply_lora`` put into a model: its layers by (layer index, fused name)."""
    context: LoRAContext
    layers: dict[tuple[int, str], LoRALinear]
    max_loras: int
    max_rank: int

    def set_slot(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load an adapter's {(layer, PEFT part): (A, scaled B)} into ``slot`` of every layer."""
        by_layer: dict[tuple[int, str], dict] = {}
        for (layer, part), ab in weights.items():
            by_layer.setdefault((layer, TARGET_MODULES[part][0]), {})[part] = ab
        for key, module in self.layers.items():
            module.set_slot(slot, by_layer.get(key, {}))


def apply_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> LoRALayers:
    """Wrap the model's adaptable linears in place (after quantization and TP wrapping) and
    register the pre-hook that reads each forward's ``lora_mapping``."""
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(l, "self_attn") and hasattr(l, "mlp") for l in layers):
        raise ValueError(f"enable_lora: {type(model).__name__} has no Llama-style decoder layers to adapt")
    split = getattr(model, "tensor_parallel_split", None)
    context = LoRAContext()
    device = model.embed_tokens.weight.device
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for i, layer in enumerate(layers):
        for fused, (parts, row_parallel) in _FUSED.items():
            owner = getattr(layer, _OWNER[fused])
            base = getattr(owner, fused, None)
            if base is None:
                raise ValueError(f"enable_lora: layer {i} of {type(model).__name__} has no {fused}")
            in_features, out_ranges = _ranges(model.config, parts, row_parallel, split)
            tp = getattr(base, "tp", None) if row_parallel and split is not None else None
            module = LoRALinear(base, parts, out_ranges, in_features, max_loras, max_rank, context, dtype, device, tp)
            setattr(owner, fused, module)
            wrapped[(i, fused)] = module

    def hand_over_mapping(_module, args, kwargs):
        meta = kwargs.get("meta", args[3] if len(args) > 3 else None)
        context.mapping = getattr(meta, "lora_mapping", None)

    def clear_mapping(_module, _args, _output):
        context.mapping = None

    model.register_forward_pre_hook(hand_over_mapping, with_kwargs=True)
    model.register_forward_hook(clear_mapping)
    return LoRALayers(context, wrapped, max_loras, max_rank)


def _ranges(config, parts, row_parallel: bool, split) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """(A's input columns, each part's B rows) this rank keeps."""
    from specdec.lora.adapter import module_shapes

    shapes = module_shapes(config)
    in_features = shapes[parts[0]][0]
    if split is None:
        return (0, in_features), [(0, shapes[p][1]) for p in parts]
    if row_parallel:
        return split.rows(_SPLIT_KIND[parts[0]]), [(0, shapes[parts[0]][1])]
    return (0, in_features), [split.rows(_SPLIT_KIND[p]) for p in parts]
