"""Build every C++ CPU kernel this machine runs, ahead of first use, ``jobs`` at a time.

Each kernel is compiled on first use (``cpp_build``), one compiler run of 15-60 s per kernel and
instruction set. A fresh machine about to use many of them (the test suite, an image build) can
build them all first and in parallel::

    python -m specdec.kernels.cpu.prebuild --jobs 2

Every build goes through the kernel's own loader (the same flags, folder and build lock as first
use), so another process that asks for a kernel while it is being built here waits for that build,
then loads it. A kernel that cannot build here warns at its first use exactly as it would have;
nothing is cached about failures. Compilers run as child processes, so ``jobs`` threads of one
Python process keep ``jobs`` cores busy. SIGTERM (or Ctrl-C) starts no further build and lets the
ones under way finish: a compiler killed mid-build would leave its folder's lock behind.
"""
from __future__ import annotations

import argparse
import functools
import os
import queue
import signal
import threading
import time
import warnings
from typing import Callable

from specdec.kernels.cpu import amx_cpu, attention_rows, cpu_ops, lora_cpu, moe_cpu, woq_cpu


def targets() -> list[tuple[str, Callable[[], object]]]:
    """(label, loader call) for each kernel this CPU runs: those of the best instruction set of
    ``woq_cpu.cpu_isas`` first, the ones every float32 model uses (``cpu_ops``) or others load
    before them earlier, then the same kernels for the other instruction sets."""
    isas, a8_isas = woq_cpu.cpu_isas(), woq_cpu.cpu_isas(a8=True)
    calls: list[tuple[str, Callable[[], object]]] = [("cpu_ops", cpu_ops.extension)]
    for rank, isa in enumerate(isas):
        calls.append((f"woq {isa}", functools.partial(woq_cpu.extension, isa)))
        calls.append((f"attention_rows {isa}", functools.partial(attention_rows.extension, isa)))
        if isa in a8_isas:
            calls.append((f"woq_a8 {isa}", functools.partial(woq_cpu.extension_a8, isa)))
        if rank == 0:
            if amx_cpu.cpu_has_amx():
                calls.append(("amx", amx_cpu.extension))
            if amx_cpu.cpu_has_amx_int8():  # after woq_a8 and amx, which it loads first
                calls.append(("woq_a8 amx", amx_cpu.extension_a8))
            if lora_cpu.kernel_possible():
                calls.append(("lora", lora_cpu.extension))
        if isa in a8_isas:
            calls.append((f"moe {isa}", functools.partial(moe_cpu.extension, isa)))
    return calls


def build_all(calls: list[tuple[str, Callable[[], object]]], jobs: int, stop: threading.Event | None = None,
              report: Callable[[str], None] | None = None) -> dict[str, bool]:
    """Run ``calls`` on ``jobs`` threads, in order; label -> whether its kernel loaded. Once ``stop`` is
    set no further call starts."""
    stop = stop or threading.Event()
    todo: queue.Queue = queue.Queue()
    for call in calls:
        todo.put(call)
    done: dict[str, bool] = {}

    def work():
        while not stop.is_set():
            try:
                label, call = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            try:
                done[label] = call() is not None
            except Exception:  # a loader's own error (a bad environment variable): raised again at first use
                done[label] = False
            if report:
                report(f"{label}: {'built' if done[label] else 'not built'} ({time.perf_counter() - start:.0f} s)")

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)  # wakes the main thread, so a signal handler can set ``stop``
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.kernels.cpu.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at once (default: the CPUs)")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    os.environ.pop(woq_cpu.ISA_ENV, None)  # each call names its instruction set; the rest take the best
    warnings.simplefilter("ignore")  # a kernel that does not build here warns at its first use
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    done = build_all(targets(), args.jobs, stop, None if args.quiet else functools.partial(print, flush=True))
    return 0 if all(done.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
