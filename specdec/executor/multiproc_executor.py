"""Tensor parallelism: one worker process per rank, rank 0 (the driver) in the engine's process.

Each step the driver sends the ``SchedulerOutput`` to every rank (pickled, through a
shared-memory queue per spawned rank, cheaper per step than broadcasts over gloo;
over the process group for torchrun's ranks, which may sit on other nodes); every rank runs
the same step on its shard. Row-parallel layers all-reduce and the LM head gathers the
whole vocabulary, so every rank holds identical logits and draws identical random numbers (the
same seed, the same order): every rank samples the same tokens, and a checksum collective per
step proves it. Only the driver's ``ModelRunnerOutput`` is used.

Ranks are spawned here (torch.multiprocessing, spawn) on one node, or were started by torchrun /
any launcher that sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: then every
rank runs the same command and the ranks above 0 serve the driver until it stops, then exit.
A rank that dies or hangs makes the driver raise within the process group's timeout
(``SPECDEC_DIST_TIMEOUT``, 30 s by default), naming the rank where it can; a spawned rank that
exits before it starts serving (an unguarded script: see ``check_not_bootstrapping``) at once.
"""
from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import weakref

import torch

from specdec.distributed.parallel_state import (
    TensorParallelGroup,
    init_tensor_parallel,
    launched_by_torchrun,
    timeout_seconds,
)
from specdec.engine.scheduler_output import SchedulerOutput
from specdec.executor.executor import Executor
from specdec.spec_decode.methods import registering_modules
from specdec.worker.model_runner_output import ModelRunnerOutput
from specdec.worker.worker import Worker


UNGUARDED_MAIN = (
    "tensor_parallel_size > 1 starts one process per rank with multiprocessing's 'spawn', and each "
    "re-imports the script that created the engine: create it under `if __name__ == \"__main__\":` "
    "(torchrun-started ranks need no guard)")
_UNGUARDED_EXIT_CODE = 87  # a spawned rank that found itself re-running the script's engine


def check_not_bootstrapping() -> None:
    """Refuse to build a tensor-parallel engine while this process is a spawned rank importing its
    parent's main module: the parent's script creates its engine at import, without the guard.
    The rank exits with a code the parent recognises, which then raises the same error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # set during spawn's bootstrap
        print(f"specdec: {UNGUARDED_MAIN}", file=sys.stderr, flush=True)
        raise SystemExit(_UNGUARDED_EXIT_CODE)


def _wait_until_started(procs: list, started, deadline_s: float) -> None:
    """Each spawned rank reports its rank once it runs ``_rank_main`` (its bootstrap done); one that
    exits first stops the engine here, not after the process group's timeout."""
    pending = set(range(1, len(procs) + 1))
    deadline = time.monotonic() + deadline_s
    while pending and time.monotonic() < deadline:
        try:
            pending.discard(started.get(timeout=0.05))
            continue
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs, start=1):
            if rank in pending and proc.exitcode is not None:
                for other in procs:
                    other.kill()
                if proc.exitcode == _UNGUARDED_EXIT_CODE:
                    raise RuntimeError(UNGUARDED_MAIN)
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it started")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_threads(cfg, world: int, device_type: str) -> None:
    if cfg.num_threads is None and device_type == "cpu":  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _device_type(cfg) -> str:
    from specdec.worker.device import resolve_device

    return resolve_device(cfg.device).type


def _serve(worker: Worker, tp: TensorParallelGroup, receive) -> None:
    """A non-driver rank: run what the driver sends until it says stop."""
    while True:
        command, payload = receive()
        if command == "execute":
            out = worker.execute(payload)
            tp.check_same(out.sampled_token_ids)
        elif command == "finish":
            worker.finish_requests(payload)
        elif command == "rpc":
            name, args = payload
            getattr(worker, name)(*args)
        elif command == "gather":
            name, args = payload
            tp.gather_objects(getattr(worker, name)(*args))
        elif command == "stop":
            tp.min_int(0)  # both sides done with the group before either tears it down
            return


def _rank_main(rank: int, world: int, address: tuple[str, int], cfg, worker_args: tuple, commands, started,
               method_modules: tuple[str, ...]) -> None:
    started.put(rank)
    for module in method_modules:  # methods registered in the driver's process (benchmark-only ones too)
        importlib.import_module(module)
    device_type = _device_type(cfg)
    _set_threads(cfg, world, device_type)
    tp = init_tensor_parallel(rank, world, device_type, address)
    _serve(Worker(cfg, *worker_args, tp=tp), tp, lambda: pickle.loads(commands.get()))


class MultiprocExecutor(Executor):
    def __init__(self, cfg, worker_args: tuple):
        """``worker_args``: what ``Worker`` takes after the config (model path, config, vocab
        size, max_model_len, EOS ids)."""
        world = cfg.tensor_parallel_size
        device_type = _device_type(cfg)
        _set_threads(cfg, world, device_type)
        self._procs = []
        self._queues = []  # one command queue per spawned rank (None: broadcast over the group)
        if launched_by_torchrun():
            rank, launched = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if launched != world:
                raise ValueError(f"tensor_parallel_size {world} but the launcher started {launched} ranks")
            tp = init_tensor_parallel(rank, world, device_type, None, int(os.environ.get("LOCAL_RANK", rank)))
            if rank != 0:  # this process only serves the driver
                _serve(Worker(cfg, *worker_args, tp=tp), tp, tp.broadcast_object)
                tp.destroy_launcher_group()
                sys.exit(0)
        else:
            if device_type == "cuda" and world > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; "
                                 f"{torch.cuda.device_count()} are visible")
            address = ("127.0.0.1", _free_port())
            ctx = torch.multiprocessing.get_context("spawn")
            started = ctx.Queue()
            for rank in range(1, world):
                commands = ctx.SimpleQueue()
                proc = ctx.Process(target=_rank_main, name=f"specdec-tp-rank{rank}", daemon=True,
                                   args=(rank, world, address, cfg, worker_args, commands, started,
                                         registering_modules()))
                proc.start()
                self._procs.append(proc)
                self._queues.append(commands)
            _wait_until_started(self._procs, started, timeout_seconds())
            tp = init_tensor_parallel(0, world, device_type, address)
        self.tp = tp
        self.driver_worker = Worker(cfg, *worker_args, tp=tp)
        self._stopped = False
        self._deliver = functools.partial(_deliver, self._queues, tp)  # holds no reference to self
        self._finalizer = weakref.finalize(self, _stop, self._deliver, tp, self._procs, launched_by_torchrun())

    @property
    def num_kv_blocks(self) -> int:
        return self.driver_worker.num_kv_blocks

    @property
    def runtime_plan(self):
        return self.driver_worker.plan

    def _send(self, command: str, payload=None) -> float:
        self._check_ranks()
        started = time.perf_counter()
        self._deliver((command, payload))
        return time.perf_counter() - started


    def _check_ranks(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                self.shutdown()
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}); the engine stops")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        broadcast = self._send("execute", sched)
        out = self.driver_worker.execute(sched)
        self.tp.check_same(out.sampled_token_ids)
        out.comm_seconds += broadcast
        return out

    def finish_requests(self, num_tokens: dict[str, int]) -> None:
        self._send("finish", num_tokens)
        self.driver_worker.finish_requests(num_tokens)

    def collective_rpc(self, method: str, *args):
        self._send("rpc", (method, args))
        return getattr(self.driver_worker, method)(*args)

    def gather_rpc(self, method: str, *args) -> list:
        """``Worker.<method>(*args)`` of every rank, in rank order."""
        self._send("gather", (method, args))
        return self.tp.gather_objects(getattr(self.driver_worker, method)(*args))

    def shutdown(self) -> None:
        self._finalizer()


def _deliver(queues: list, tp: TensorParallelGroup, message) -> None:
    if queues:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for q in queues:
            q.put(data)
    else:
        tp.broadcast_object(message)


def _stop(deliver, tp: TensorParallelGroup, procs: list, default_group: bool) -> None:
    """Tell the ranks to stop (if they still listen), wait a little, then make sure they are gone."""
    if all(p.is_alive() for p in procs):
        try:
            deliver(("stop", None))
            tp.min_int(0)
        except Exception:  # noqa: BLE001 - a broken group: the ranks are terminated below
            pass
    if default_group:  # torchrun: tear the launcher's group down before the interpreter does
        tp.destroy_launcher_group()
    deadline = time.monotonic() + min(5.0, timeout_seconds())
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
