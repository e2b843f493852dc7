"""llama.cpp's two-level GGUF grids (K-quants and IQ4) as shared vocabulary: which type holds what, the codes of a
weight on one, and their exact dequantization.

A row is cut into super-blocks (256 columns; IQ4_NL: 32) and these into sub-blocks (16 or 32 columns). Each
super-block stores fp16 `d` (and `dmin` for the types with mins); each sub-block an integer scale code `sc`
(and min code `m`); each weight an integer code `q` (ggml-common.h, `block_q4_K` etc.):

| type | super | sub | q bits | sub-block scale | weight |
|---|---|---|---|---|---|
| Q2_K | 256 | 16 | 2 | 4-bit sc, 4-bit m | (d·sc)·q − (dmin·m) |
| Q3_K | 256 | 16 | 3 | 6-bit sc − 32 | (d·sc)·(q − 4) |
| Q4_K | 256 | 32 | 4 | 6-bit sc, 6-bit m | (d·sc)·q − (dmin·m) |
| Q5_K | 256 | 32 | 5 | 6-bit sc, 6-bit m | (d·sc)·q − (dmin·m) |
| Q6_K | 256 | 16 | 6 | int8 sc | (d·sc)·(q − 32) |
| IQ4_NL | 32 | 32 | 4 | none | d·K[q] |
| IQ4_XS | 256 | 32 | 4 | 6-bit sc − 32 | (d·sc)·K[q] |

K = llama.cpp's non-linear 16-value grid `kvalues_iq4nl`. `dequantize` computes each weight in float32 with the
same operations in the same order as llama.cpp's `dequantize_row_*` (and `gguf.quants`), so the weights our
solver writes back are those llama.cpp reads from the file, bit for bit (tests/test_gguf_kquants.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl


@dataclass(frozen=True)
class KType:
    """One grid: `sc_lo..sc_hi` the signed sub-block multipliers it stores (`sc_offset` added when packed),
    `m_max` the largest min code (0: no mins), `q_offset` subtracted from a code (or `values` looked up)."""

    name: str
    super: int
    sub: int
    bits: int
    sc_lo: int
    sc_hi: int
    sc_offset: int = 0
    m_max: int = 0
    q_offset: int = 0
    values: tuple[int, ...] | None = None
    block_bytes: int = 0

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    @property
    def has_min(self) -> bool:
        return self.m_max > 0

    @property
    def subs(self) -> int:
        """Sub-blocks per super-block."""
        return self.super // self.sub

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.super


KTYPES: dict[str, KType] = {
    "Q2_K": KType("Q2_K", 256, 16, 2, 0, 15, m_max=15, block_bytes=84),
    "Q3_K": KType("Q3_K", 256, 16, 3, -32, 31, sc_offset=32, q_offset=4, block_bytes=110),
    "Q4_K": KType("Q4_K", 256, 32, 4, 0, 63, m_max=63, block_bytes=144),
    "Q5_K": KType("Q5_K", 256, 32, 5, 0, 63, m_max=63, block_bytes=176),
    "Q6_K": KType("Q6_K", 256, 16, 6, -128, 127, q_offset=32, block_bytes=210),
    "IQ4_NL": KType("IQ4_NL", 32, 32, 4, 1, 1, values=IQ4_VALUES, block_bytes=18),
    "IQ4_XS": KType("IQ4_XS", 256, 32, 4, -32, 31, sc_offset=32, values=IQ4_VALUES, block_bytes=136),
}


@dataclass
class KCodes:
    """A matrix on a KType grid. q: (rows, cols) uint8 codes 0..maxq; d: (rows, nsb) float32 fp16 values;
    sc: (rows, nsub) int32 signed multipliers in sc_lo..sc_hi; dmin, m: the same for the mins, or None."""

    ktype: KType
    q: np.ndarray
    d: np.ndarray
    sc: np.ndarray
    dmin: np.ndarray | None = None
    m: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def sub_scales(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(S, M): (rows, nsub) float32 each sub-block's step d·sc and offset dmin·m (None without mins),
        computed as llama.cpp does."""
        return sub_scales(self.ktype, self.d, self.sc, self.dmin, self.m)

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32, llama.cpp's weights of these codes."""
        S, M = self.sub_scales()
        t = self.ktype
        rows, cols = self.q.shape
        v = code_values(t, self.q).reshape(rows, -1, t.sub)  # (rows, nsub, sub)
        w = S[:, :, None] * v
        if M is not None:
            w = w - M[:, :, None]
        return w.reshape(rows, cols)


def sub_scales(t: KType, d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None,
               m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Each sub-block's float32 step d·sc and offset dmin·m from a super-block's d/dmin (rows, nsb) and the
    sub-blocks' integer codes (rows, nsub). IQ4_NL has no sub-block scale: its step is d itself."""
    if t.name == "IQ4_NL":
        return d.astype(np.float32), None
    S = np.repeat(d.astype(np.float32), t.subs, axis=1) * sc.astype(np.float32)
    M = None if dmin is None else np.repeat(dmin.astype(np.float32), t.subs, axis=1) * m.astype(np.float32)
    return S, M


def code_values(t: KType, q: np.ndarray) -> np.ndarray:
    """The float32 value of each code: K[q] on the non-linear grid, else q − q_offset."""
    if t.values is not None:
        return np.asarray(t.values, dtype=np.float32)[q.astype(np.int64)]
    return (q.astype(np.int32) - t.q_offset).astype(np.float32)


def fp16(x: np.ndarray | float) -> np.ndarray:
    """float32 values rounded to fp16 and back (what a block's d stores)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def nearest_value(t: KType, x: np.ndarray) -> np.ndarray:
    """The code of the nearest grid value to x (in units of the step): llama.cpp's `best_index_int8` on the
    non-linear grid (ties to the upper value), `nearest_int` clamped on a uniform one (ties to even)."""
    if t.values is None:
        return np.clip(np.rint(x) + t.q_offset, 0, t.maxq).astype(np.uint8)
    vals = np.asarray(t.values, dtype=np.float32)
    mu = np.clip(np.searchsorted(vals, x, side="right"), 1, len(vals) - 1)
    lower = (x - vals[mu - 1]) < (vals[mu] - x)
    idx = np.where(lower, mu - 1, mu)
    idx = np.where(x <= vals[0], 0, np.where(x >= vals[-1], len(vals) - 1, idx))
    return idx.astype(np.uint8)
