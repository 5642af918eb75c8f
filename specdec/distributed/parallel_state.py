"""The tensor-parallel group a worker belongs to, over torch.distributed (NCCL on CUDA, RCCL on
ROCm, gloo on CPU), and the collectives the parallel layers and the executor use.

Ranks are started either by the engine (``MultiprocExecutor`` spawns them on one node) or by
torchrun / any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; rank 0 is the driver. Every collective has the group's timeout, so a rank that
died or hangs makes the others raise instead of waiting forever.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def timeout_seconds() -> float:
    return float(os.environ.get("SPECDEC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    comm_seconds: float = 0.0  # time inside the model's collectives since the last ``take_comm_seconds``
    _cpu_group: object = field(default=None, repr=False)  # gloo group for host objects (NCCL cannot send them)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- collectives on the model's tensors ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(x)
        self.comm_seconds += time.perf_counter() - started
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], ranks in order."""
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def take_comm_seconds(self) -> float:
        seconds, self.comm_seconds = self.comm_seconds, 0.0
        return seconds

    # ---- host-side control ----
    def broadcast_object(self, obj=None):
        """The driver's ``obj`` on every rank (pickled bytes over the process group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def check_same(self, obj) -> None:
        """Raise unless every rank holds the same ``obj`` (sampling must never diverge)."""
        digest = int.from_bytes(hashlib.blake2b(pickle.dumps(obj), digest_size=7).digest(), "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._cpu_group)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(f"tensor-parallel rank {self.rank}: ranks decided different tokens this step")


def init_tensor_parallel(rank: int, world_size: int, device_type: str, init_method: str | None = None,
                         local_rank: int | None = None) -> TensorParallelGroup:
    """Join (or create) the default process group and return this rank's group handle."""
    if device_type == "cuda":
        local = rank if local_rank is None else local_rank
        if local >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {world_size} needs {local + 1} GPUs on this node; "
                             f"{torch.cuda.device_count()} are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"  # RCCL on ROCm builds answers to the same name
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return TensorParallelGroup(rank, world_size, device, _cpu_group=cpu_group)
