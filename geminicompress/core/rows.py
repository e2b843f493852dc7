"""Blocks of rows under a byte budget: how a big matrix is worked on without a whole-matrix temporary.

A 262,144 x 4,096 output head holds 1.07 G weights: each whole-matrix float32 temporary of it is 4 GiB. Every
row of a linear's weight gives its own output column, and every row of a (positions, vocabulary) logit block
its own position, so the work can go a block of rows at a time with the same numbers. These two functions are
the one rule for the block (the head's chunks of positions, INT8 quantization, the kernels' packs and the
dequantizing reader all use it), and `BLOCK_BYTES` the one budget of the blocks that are not a kernel's packs.
"""

from __future__ import annotations

from typing import Iterator

BLOCK_BYTES = 64 << 20  # the temporaries of one block: rows converted, quantized, dequantized, packed or unpacked


def rows_within(columns: int, budget: int, itemsize: int = 4) -> int:
    """Rows of `columns` values of `itemsize` bytes that fit `budget` bytes (at least one)."""
    return max(1, budget // (itemsize * max(1, columns)))


def spans(n: int, rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive blocks of `rows` rows covering range(n)."""
    for start in range(0, n, rows):
        yield start, min(start + rows, n)
