"""Build and load one of specdec's C++ CPU kernels (``csrc/*.cpp``) on first use.

``torch.utils.cpp_extension.load`` compiles a source once per torch version into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/specdec/torch_extensions`` (each in its own folder); nothing
is built at install time. Where a kernel cannot run (a CPU flag missing, no compiler, a failed
build, its disabling environment variable set) ``load_ops`` returns None after one warning saying
why and what runs instead. Processes that build or load the same kernel at once take turns
(``build_lock``), and a build killed mid-compile does not hold up the next one.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

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


# torch's build baton (``lock`` in the build folder) is a bare file that a build killed mid-compile leaves
# behind, and every later build of that folder waits on it forever. Each specdec build holds an flock on
# a file of its own there around torch's build; the kernel drops an flock when its holder dies, so a
# baton found while holding ours belongs to no live build and is removed.
BATON = "lock"
BUILD_LOCK = "specdec_build.flock"


@contextlib.contextmanager
def build_lock(directory: str):
    """Hold ``directory``/``BUILD_LOCK`` exclusively (waiting for another process's build or load of
    the same extension to finish), with any baton a killed build left there removed."""
    if fcntl is None:  # no flock (Windows): torch's baton alone
        yield
        return
    with open(os.path.join(directory, BUILD_LOCK), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            baton = os.path.join(directory, BATON)
            if os.path.exists(baton):
                warnings.warn(f"specdec: removing a build lock left by an interrupted build: {baton}", stacklevel=3)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(baton)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


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
        with build_lock(directory):
            load(name=name, sources=[str((csrc or CSRC) / source)], extra_cflags=[*flags, "-fopenmp"],
                 extra_ldflags=["-fopenmp"], build_directory=directory, is_python_module=False, verbose=False)
        return getattr(torch.ops, namespace)
    except Exception as e:  # no compiler, no headers, a failed build: the torch path still runs
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        warnings.warn(f"specdec: could not build {what} ({type(e).__name__}: {last}); {fallback}", stacklevel=4)
        return None
