"""Give freed tensor memory back to the operating system (glibc), so resident memory tracks what is live.

glibc serves allocations above a threshold with mmap and returns them on free, but it raises that
threshold (up to 32 MB) every time such a block is freed. After that, the activation-sized buffers of
layer-by-layer calibration (a few MB each) come from the heap, whose freed pages stay resident: on the
demo model, GPTQ's resident memory grew by ~0.8 GB in the first layer that way (measured; 1.26 GB
anonymous after layer 0 against 0.53 GB with a fixed threshold). Fixing the threshold at 1 MB (which
also switches off the dynamic adjustment) keeps big buffers on mmap. A no-op where glibc is absent.

Smaller allocations still come from the heap, and the free pages between live chunks stay resident
until `malloc_trim` hands them back; layer-by-layer calibration calls `release_free_heap()` after each
layer. Measured on the demo model (GPTQ 4-bit, RSS sampled every 0.25 s): peak 1,528 MiB without it,
1,412 MiB with it; the call takes milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (glibc or another), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the operating system (glibc malloc_trim); True if it ran."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):  # musl or another libc
        return False
    libc.malloc_trim(0)
    return True


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold to 1 MB; True if it was set."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):  # musl or another libc without mallopt
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
