"""The allocator setting that keeps resident memory close to the live tensors."""

import sys

import pytest

from geminicompress.memory import release_free_heap, return_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_glibc_accepts_the_fixed_mmap_threshold():
    assert return_freed_memory() is True
    assert return_freed_memory() is True  # idempotent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim exists on Linux only")
def test_free_heap_pages_go_back_to_the_system():
    """Many small freed buffers with one live one at the top of the heap: without a trim their pages stay
    resident; release_free_heap gives most of them back."""
    import torch

    def anon_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon"))

    return_freed_memory()
    small = [torch.ones(100_000) for _ in range(1000)]  # 400 KB each, below the mmap threshold: the heap
    keep = torch.ones(1000)  # noqa: F841 (pins the top of the heap, so a plain free cannot shrink it)
    del small
    before = anon_kib()
    assert release_free_heap() is True
    assert before - anon_kib() > 200_000  # of the ~400 MB freed, most is handed back
