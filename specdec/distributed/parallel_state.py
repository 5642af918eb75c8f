"""The tensor-parallel group a worker belongs to, over torch.distributed (NCCL on CUDA, RCCL on
ROCm, gloo on CPU), and the collectives the parallel layers and the executor use.

Ranks are started either by the engine (``MultiprocExecutor`` spawns them on one node; each
engine gets a process group of its own on a fresh port, so several engines can live in one
process) or by torchrun / any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` (the default group). Rank 0 is the driver. Every
collective has the group's timeout, so a rank that died or hangs makes the others raise
instead of waiting forever.
"""
from __future__ import annotations

import datetime
import gc
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


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def _reduce(op) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    pg: object = field(repr=False)  # the process group of the model's tensors
    cpu_pg: object = field(repr=False)  # a gloo group for host-side control (NCCL cannot send host objects)
    store: object = field(default=None, repr=False)  # the TCPStore the groups were built on: must outlive them
    comm_seconds: float = 0.0  # inside the model's collectives since the last ``take_comm_seconds``

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def destroy_launcher_group(self) -> None:
        """Under torchrun: destroy the launcher's default group and drop this rank's references to
        it now, so its C++ objects and threads are freed here rather than by whoever holds the last
        reference at interpreter exit, where a rank could abort with "terminate called without an
        active exception"."""
        dist.destroy_process_group()
        self.pg = self.cpu_pg = None
        gc.collect()

    # ---- collectives on the model's tensors ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self.comm_seconds += time.perf_counter() - started
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world_size * n], ranks in order."""
        started = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.pg.allgather([parts], [x]).wait()
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def take_comm_seconds(self) -> float:
        seconds, self.comm_seconds = self.comm_seconds, 0.0
        return seconds

    # ---- host-side control ----
    def broadcast_object(self, obj=None):
        """The driver's ``obj`` on every rank: its pickled length, then its bytes."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.is_driver else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.cpu_pg.broadcast([length], _root0()).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver else \
            torch.empty(int(length), dtype=torch.uint8)
        self.cpu_pg.broadcast([buf], _root0()).wait()
        return obj if self.is_driver else pickle.loads(buf.numpy().tobytes())

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (small objects: one pickle each)."""
        data = pickle.dumps(obj)
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.cpu_pg.allgather([lengths], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        size = max(int(n) for n in lengths)
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        self.cpu_pg.allgather([parts], [mine]).wait()
        return [pickle.loads(p[:int(n)].numpy().tobytes()) for p, n in zip(parts, lengths)]

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.cpu_pg.allreduce([t], _reduce(dist.ReduceOp.MIN)).wait()
        return int(t.item())

    def check_same(self, obj) -> None:
        """Raise unless every rank holds the same ``obj`` (sampling must never diverge)."""
        digest = int.from_bytes(hashlib.blake2b(pickle.dumps(obj), digest_size=7).digest(), "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64)
        self.cpu_pg.allreduce([t], _reduce(dist.ReduceOp.MAX)).wait()
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(f"tensor-parallel rank {self.rank}: ranks decided different tokens this step")


def _device_for(device_type: str, world_size: int, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {world_size} needs {local_rank + 1} GPUs on this node; "
                         f"{torch.cuda.device_count()} are visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init_tensor_parallel(rank: int, world_size: int, device_type: str, address: tuple[str, int] | None = None,
                         local_rank: int | None = None) -> TensorParallelGroup:
    """This rank's group: a process group of its own on ``address`` (host, port; rank 0 hosts
    the store), or, with ``address`` None, the launcher's default group (``env://``)."""
    device = _device_for(device_type, world_size, rank if local_rank is None else local_rank)
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if address is None:
        backend = "nccl" if device.type == "cuda" else "gloo"  # RCCL answers to "nccl" on ROCm builds
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        pg = dist.group.WORLD
        cpu_pg = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else pg
        return TensorParallelGroup(rank, world_size, device, pg, cpu_pg)
    store = dist.TCPStore(address[0], address[1], world_size, is_master=rank == 0, timeout=timeout)
    cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, world_size, timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("dev/", store), rank, world_size, opts)
    else:
        pg = cpu_pg
    return TensorParallelGroup(rank, world_size, device, pg, cpu_pg, store)
