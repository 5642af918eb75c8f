"""The server's remedy for allocator fragmentation (glibc only; elsewhere these do nothing).

Each thread that allocates (event loop, engine thread, tokenizer pool) gets its own malloc
arena by default (up to 8 per core) and freed tensor, string and JSON memory stays stranded
in them; and the engine keeps freed heap mapped for its steps' sake (``runtime/device.py``).
So RSS climbs round after round with nothing leaked. The server caps the arenas at two and,
when the engine goes idle, hands free heap pages back to the OS (``malloc_trim``); the next
step after an idle spell re-faults what it needs, which the steps in a busy run never do.
"""
from __future__ import annotations

import ctypes
import functools
import os

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_malloc_arenas(num_arenas: int = 2) -> bool:
    """Cap glibc's arenas, unless $MALLOC_ARENA_MAX already does; whether it applied."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, num_arenas))


def release_free_memory() -> bool:
    """Return free heap pages of every arena to the OS; whether any were."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
