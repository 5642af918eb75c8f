"""Build and load one of specdec's C++ CPU kernels (``csrc/*.cpp``) on first use.

``torch.utils.cpp_extension.load`` compiles a source once per torch version into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/specdec/torch_extensions`` (each in its own folder); nothing
is built at install time. Where a kernel cannot run (a CPU flag missing, no compiler, a failed
build, its disabling environment variable set) ``load_ops`` returns None after one warning saying
why and what runs instead.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def build_dir(name: str) -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(Path.home(), ".cache", "specdec", "torch_extensions")
    path = os.path.join(root, f"torch{torch.__version__.replace('+', '_')}", name)
    os.makedirs(path, exist_ok=True)
    return path


# torch's build lock is a bare file that a build interrupted mid-compile leaves behind, and every
# later build waits on it forever; no build of these sources takes this long
STALE_LOCK_SECONDS = 900


def clear_stale_lock(path: str, now: float | None = None) -> bool:
    """Remove ``path``/lock when it is older than ``STALE_LOCK_SECONDS``; True if it was removed."""
    lock = os.path.join(path, "lock")
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except OSError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    warnings.warn(f"specdec: removing a build lock left {age / 60:.0f} minutes ago by an interrupted build: {lock}",
                  stacklevel=3)
    try:
        os.remove(lock)
    except OSError:
        return False
    return True


def disabled(env: str) -> bool:
    return os.environ.get(env, "0") not in ("", "0")


def load_ops(name: str, source: str, namespace: str, flags: list[str], *, needs: tuple[str, ...] = (),
             what: str, fallback: str, disable_env: str | None = None, warn_disabled: bool = False,
             csrc: Path | None = None):
    """``torch.ops.<namespace>`` once ``csrc/<source>`` is built and loaded, or None (after one
    warning: "could not build <what>; <fallback>"). ``csrc``: another sources folder."""
    if disable_env and disabled(disable_env):
        if warn_disabled:
            warnings.warn(f"specdec: {disable_env}: {fallback}", stacklevel=4)
        return None
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        warnings.warn(f"specdec: this CPU lacks {', '.join(missing)}; {fallback}", stacklevel=4)
        return None
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for is inline OpenMP in the headers, serial without it; the
        # extension then uses the libgomp torch already loaded (same soname), so one thread pool
        directory = build_dir(name)
        clear_stale_lock(directory)
        load(name=name, sources=[str((csrc or CSRC) / source)], extra_cflags=[*flags, "-fopenmp"],
             extra_ldflags=["-fopenmp"], build_directory=directory, is_python_module=False, verbose=False)
        return getattr(torch.ops, namespace)
    except Exception as e:  # no compiler, no headers, a failed build: the torch path still runs
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        warnings.warn(f"specdec: could not build {what} ({type(e).__name__}: {last}); {fallback}", stacklevel=4)
        return None
