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

The price of mmap is a fresh, zeroed page for every page of every big buffer. Layer-by-layer calibration
allocates the same activation-sized buffers thousands of times, so inside it `heap_reuse()` serves
buffers up to 32 MB from the heap again (reused without page faults) and the per-layer `malloc_trim`
bounds what stays resident. Measured on the demo model (GPTQ 4-bit, 32 windows, float32, 2 cores):
6.5M page faults and 60 s in the one-pass calibration with mmap, 2.2M and 46-50 s with heap reuse; the
peak resident memory stayed about the same (1.35-1.6 GiB over runs, as the heap's layout varies).
distill's training loop, plan and repair run inside it too (demo: 59-63 -> 73-76 training tokens/s, peak
+0.8 GiB). eval's quality pass opens it per window around the decoder only (models/head.window_chunks), not
around the head's 32 MB chunks, which a block around the whole pass kept resident (+160 MB reported peak);
blocks nest (an inner one changes nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from contextlib import contextmanager, suppress
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
HEAP_REUSE_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit
HEAP_KEEP_BYTES = 64 << 20  # free memory at the heap's top that free() leaves in place inside heap_reuse
_DEFAULT_TRIM_BYTES = 128 << 10  # glibc's M_TRIM_THRESHOLD, fixed once the mmap threshold is set
_threshold_fixed = False  # return_freed_memory() ran: glibc's dynamic threshold is off
_reuse_depth = 0  # heap_reuse blocks open (0 or 1: a nested one changes nothing)


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (glibc or another), None elsewhere. Cached: find_library runs ldconfig."""
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
    global _threshold_fixed
    _threshold_fixed = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return _threshold_fixed


@contextmanager
def heap_reuse() -> Iterator[None]:
    """Inside the block, buffers up to HEAP_REUSE_BYTES come from the heap, and free() does not hand the
    heap's top back to the system until HEAP_KEEP_BYTES are free there (otherwise a buffer freed at the
    top is returned at once and the next one faults its pages in again); afterwards the heap is trimmed
    and the 1 MB threshold is back. Only where return_freed_memory() fixed the threshold (the
    CLI): otherwise glibc's own dynamic threshold already reuses the heap, and it cannot be restored."""
    global _reuse_depth
    if not _threshold_fixed or _reuse_depth:  # nested: the outer block's settings hold until it ends
        yield
        return
    _reuse_depth += 1
    _mallopt(_M_MMAP_THRESHOLD, HEAP_REUSE_BYTES)
    _mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)
    try:
        yield
    finally:
        _reuse_depth -= 1
        release_free_heap()
        _mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_BYTES)
        _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):  # musl or another libc without mallopt
        return False
    return bool(libc.mallopt(param, value))


# The one "does it fit" rule: a model (to compress, to evaluate, as a distill teacher) or an OUT to check is
# read one decoder layer at a time, never whole, when it would take more than this share of the memory
# available when the command starts.
AUTO_FRACTION = 0.5


def available_memory() -> int:
    """Bytes of memory available to new work (MemAvailable), or 0 when unknown."""
    with suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def too_big(nbytes: int) -> bool:
    """Whether `nbytes` held in memory exceed AUTO_FRACTION of the available memory (the one rule)."""
    return nbytes > AUTO_FRACTION * available_memory()


def out_of_the_mapping(model) -> None:
    """Copy every parameter and buffer of `model` into memory of its own. A tensor read from safetensors is a
    view of the file's mapping, and one view keeps every page of it that was ever read resident (a whole
    checkpoint: the demo's 513 MB) until it goes; after this the mapping can go, and the resident set holds
    the model's tensors once."""
    import gc

    spans = _file_mappings() if Path("/proc/self/maps").is_file() else None  # None: copy every tensor
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.numel() and not tensor.is_meta and (spans is None or any(lo <= tensor.data_ptr() < hi
                                                                           for lo, hi in spans)):
            tensor.data = tensor.data.clone()  # only views of a file (a tensor with memory of its own stays)
    gc.collect()


_MADV_DONTNEED = 4  # Linux
_PAGE = mmap.PAGESIZE


def _file_mappings(private_writable: bool = False) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files (a safetensors file read by mmap); only the private,
    writable ones with `private_writable`. Empty where /proc is absent."""
    spans = []
    with suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            if not private_writable or (parts[1].startswith("rw") and parts[1].endswith("p")):
                lo, hi = parts[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return spans


def release_weights(module, names: Iterable[str]) -> int:
    """Drop the weights of `module`'s submodules `names` now (each `.weight` becomes an empty tensor of its dtype);
    returns the bytes dropped. The caller guarantees nothing else holds them (the codes kept by a quantizing
    stage make them again exactly). A weight that is a view of a file's private mapping (a checkpoint read by
    mmap, then written in place) keeps its pages resident as long as the mapping lives, whatever references go:
    its whole pages are handed back with madvise(MADV_DONTNEED) (the file's own bytes come back if anything
    read them again; nothing does). Elsewhere dropping the reference frees it."""
    import torch

    libc = _libc()
    spans = _file_mappings(private_writable=True) if libc is not None and hasattr(libc, "madvise") else []
    dropped = 0
    for name in names:
        param = module.get_submodule(name).weight
        if not param.numel():
            continue
        start, nbytes = param.data_ptr(), param.untyped_storage().nbytes()
        if any(lo <= start and start + nbytes <= hi for lo, hi in spans):
            lo, hi = -(-start // _PAGE) * _PAGE, (start + nbytes) // _PAGE * _PAGE  # whole pages inside it only
            if hi > lo:
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
        dropped += nbytes
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return dropped


def file_region(tensor) -> tuple[str, int] | None:
    """(file, byte offset) holding exactly the bytes of contiguous `tensor`: a view of a private mapping of a file
    (a checkpoint read by mmap) none of whose pages was ever written (smaps counts no anonymous page in it), so the
    file still has what the tensor holds. None otherwise (memory of its own, a written mapping, no /proc)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu" or not Path("/proc/self/smaps").is_file():
        return None
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    found = None
    with suppress(OSError), open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                if found is not None:
                    break
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if (lo <= start and start + nbytes <= hi and len(parts) >= 6 and parts[5].startswith("/")
                        and parts[1].endswith("p")):
                    found = (parts[5], int(parts[2], 16) + start - lo, None)
            elif found is not None and parts[0] == "Anonymous:":
                found = (found[0], found[1], int(parts[1]))
    if found is None or found[2] != 0:
        return None
    return found[0], found[1]


def file_view(path: str, offset: int, like):
    """A read-only tensor of `like`'s shape and dtype on a shared mapping of `path`'s bytes from `offset`: its
    pages are the page cache's, in this process's resident set only from the moment they are read until
    `drop_pages` (a frozen embedding table looked up a batch of rows at a time)."""
    import warnings

    import numpy as np
    import torch

    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(like.numel() * like.element_size(),))
    with warnings.catch_warnings():  # read-only memory: torch warns that writing to it would fail; nothing writes
        warnings.simplefilter("ignore")
        return torch.from_numpy(raw).view(like.dtype).view(like.shape)


def drop_pages(tensor) -> None:
    """Take the pages of `tensor` (a `file_view`) out of this process's resident set (madvise MADV_DONTNEED on a
    shared file mapping: the file's bytes stay in the page cache and come back when read again)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return
    start = tensor.data_ptr()
    lo, hi = start // _PAGE * _PAGE, -(-(start + tensor.numel() * tensor.element_size()) // _PAGE) * _PAGE
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
