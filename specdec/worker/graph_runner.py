"""Replay a decode/verify forward from CUDA (or HIP) graphs captured per batch size.

A decode or verification step launches hundreds of small kernels whose launch overhead
rivals their run time at batch 1-8. `GraphRunner` captures `fn(**static_inputs)` once per
batch size into a graph that reads fixed input buffers, and a step copies its inputs into the
buffers of the smallest captured size that fits, replays the graph, and returns the outputs'
first rows. ROCm builds of PyTorch expose HIP graphs through the same `torch.cuda` API.

What `fn` must guarantee (the model runner's side of the contract):
- no host synchronisation and no allocation whose size depends on tensor values;
- host-side metadata it closes over is fixed at capture (e.g. `max_query_len = K + 1` and a
  fixed `num_kv_splits` for `paged_attention_triton`);
- padding rows are harmless: give them slot -1 (KV write skips them) and a seq_len the
  block table can serve; their outputs are sliced away.
Persistent state (weights, the KV cache) is closed over by `fn`, not passed as an input.

On CPU, or with `use_graphs=False`, the runner calls `fn` on the same padded buffers
eagerly, so the padding and slicing logic is the same code with or without graphs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

Outputs = Any  # a tensor, or a tuple / list / dict of tensors


@dataclass
class _Captured:
    inputs: dict[str, torch.Tensor]  # static buffers sized for this batch size
    graph: "torch.cuda.CUDAGraph | None"
    outputs: Outputs  # the graph's static outputs (None when eager)


class GraphRunner:
    def __init__(
        self,
        fn: Callable[..., Outputs],
        make_static_inputs: Callable[[int], dict[str, torch.Tensor]],  # batch size -> buffers
        batch_sizes: Sequence[int],
        device: torch.device,
        *,
        pad_values: dict[str, int | float] | None = None,  # fill for rows a smaller input leaves; default 0
        use_graphs: bool | None = None,  # default: on CUDA/ROCm devices
        num_warmup: int = 2,  # eager runs before capture (Triton compiles, cuBLAS picks algorithms)
    ):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"GraphRunner needs batch sizes >= 1, got {list(batch_sizes)}")
        self.fn = fn
        self.make_static_inputs = make_static_inputs
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.device = torch.device(device)
        self.pad_values = dict(pad_values or {})
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and not torch.cuda.is_available():
            raise ValueError("GraphRunner(use_graphs=True) needs a CUDA or ROCm GPU")
        self.num_warmup = num_warmup
        self._captured: dict[int, _Captured] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, batch_size: int) -> int | None:
        """The captured size a batch runs at, or None when it is larger than all of them."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def capture(self) -> None:
        """Capture every batch size, largest first so the smaller graphs reuse its memory pool.
        Call after the KV cache is allocated (capture pins every buffer `fn` touches)."""
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for batch_size in reversed(self.batch_sizes):
            inputs = self.make_static_inputs(batch_size)
            graph = outputs = None
            if self.use_graphs:
                graph, outputs = self._capture_one(inputs, pool)
            self._captured[batch_size] = _Captured(inputs, graph, outputs)

    def _capture_one(self, inputs: dict[str, torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
            for _ in range(self.num_warmup):
                self.fn(**inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = self.fn(**inputs)
        return graph, outputs

    def run(self, batch_size: int, num_output_rows: int | None = None, **inputs: torch.Tensor) -> Outputs:
        """Run a batch of `batch_size`; inputs may be smaller than the static buffers along any
        axis (the rest is filled with pad_values[name]) or full-size. Returns the outputs'
        first `num_output_rows` (default batch_size) rows: views of the graph's buffers, valid
        until the next run."""
        padded = self.padded_size(batch_size)
        if padded is None:  # larger than any graph: plain eager call on the caller's tensors
            return self.fn(**inputs)
        if padded not in self._captured:
            raise RuntimeError("GraphRunner.run before capture()")
        captured = self._captured[padded]
        missing = captured.inputs.keys() - inputs.keys()
        unknown = inputs.keys() - captured.inputs.keys()
        if missing or unknown:
            raise ValueError(f"GraphRunner.run: missing inputs {sorted(missing)}, unknown inputs {sorted(unknown)}")
        for name, static in captured.inputs.items():
            self._fill(name, static, inputs[name])
        if captured.graph is not None:
            captured.graph.replay()
            outputs = captured.outputs
        else:
            outputs = self.fn(**captured.inputs)
        return _first_rows(outputs, batch_size if num_output_rows is None else num_output_rows)

    def _fill(self, name: str, static: torch.Tensor, value: torch.Tensor) -> None:
        if value.dim() != static.dim() or any(v > s for v, s in zip(value.shape, static.shape)):
            raise ValueError(f"GraphRunner input {name!r}: shape {tuple(value.shape)} does not fit the "
                             f"static buffer {tuple(static.shape)}")
        if value.shape == static.shape:
            static.copy_(value, non_blocking=True)
            return
        pad = self.pad_values.get(name, 0)
        if value.shape[1:] == static.shape[1:]:  # only the batch axis is short: pad the tail rows
            static[: value.shape[0]].copy_(value, non_blocking=True)
            static[value.shape[0]:].fill_(pad)
        else:
            static.fill_(pad)
            static[tuple(slice(0, n) for n in value.shape)].copy_(value, non_blocking=True)


def _first_rows(outputs: Outputs, num_rows: int) -> Outputs:
    if isinstance(outputs, torch.Tensor):
        return outputs[:num_rows]
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_first_rows(o, num_rows) for o in outputs)
    if isinstance(outputs, dict):
        return {k: _first_rows(v, num_rows) for k, v in outputs.items()}
    return outputs
