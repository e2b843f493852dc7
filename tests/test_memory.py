"""The allocator setting that keeps resident memory close to the live tensors."""

import sys

import pytest

from geminicompress.memory import return_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_glibc_accepts_the_fixed_mmap_threshold():
    assert return_freed_memory() is True
    assert return_freed_memory() is True  # idempotent
