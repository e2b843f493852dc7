"""Uniform integer grids for weight quantization: scales, zero points, quantize, dequantize.

Conventions (those of GPTQ / AutoGPTQ, so that packed checkpoints load in their kernels):
- Unsigned codes q in [0, 2^b - 1]; w ≈ scale · (q − zero).
- Asymmetric: the range [min(w, 0), max(w, 0)] maps onto the grid; zero = round(−min / scale).
- Symmetric: range [−max|w|, max|w|]; zero = 2^(b−1) for every group.
- Groups run along the input dimension: column j belongs to group g_idx[j] (j // group_size unless
  act-order permutes). `group_size = -1` means one group per output channel (per-channel).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from geminicompress.core.errors import InputError


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int = -1  # -1: per output channel
    sym: bool = True
    grid: str | None = None  # a llama.cpp two-level grid (core/kgrid.py KTYPES: "Q4_K", "IQ4_NL", ...), or None

    def __post_init__(self) -> None:
        if self.grid is not None:
            return  # bits / group / sym describe the grid's codes and sub-blocks (core/kgrid.py)
        if self.bits not in (2, 3, 4, 5, 8):
            raise InputError(f"bits must be 2, 3, 4, 5 or 8, got {self.bits}")
        if self.group_size == 0:
            object.__setattr__(self, "group_size", -1)
        if self.group_size < -1:
            raise InputError(f"group size must be positive, or -1/0 for per channel; got {self.group_size}")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def groups(self, columns: int) -> int:
        return 1 if self.group_size == -1 else -(-columns // self.group_size)

    def whole_groups(self, columns: int) -> bool:
        """Whether the groups tile a row of `columns` inputs exactly (per channel always does)."""
        return self.group_size == -1 or columns % self.group_size == 0


AUTO_GROUP_SIZES = (128, 64, 32)


def auto_group_size(in_features: list[int]) -> int:
    """The largest of 128, 64, 32 that divides every quantized linear's input features (`group_size: auto`).

    128 is the common default but many small models have widths it does not divide (SmolLM2-135M: 576),
    and the packed formats need whole groups."""
    for size in AUTO_GROUP_SIZES:
        if all(f % size == 0 for f in in_features):
            return size
    widths = sorted(set(in_features))
    raise InputError(f"no group size among {', '.join(map(str, AUTO_GROUP_SIZES))} divides the quantized layers' "
                     f"input features ({', '.join(map(str, widths))}); pass --group-size with a divisor of all of "
                     f"them, or -1 for one scale per output channel")


def qparams(w: torch.Tensor, spec: QuantSpec, *, sym_range: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero for the columns of `w`.  w: (out, k) -> scale (out, 1), zero (out, 1).

    Symmetric grids have the zero point fixed at 2^(b−1), so codes − zero run from −2^(b−1) to 2^(b−1) − 1:
    one more step below zero than above. `sym_range="full"`: the smallest scale that reaches both the
    row's largest weight (with 2^(b−1) − 1 steps) and its most negative one (with 2^(b−1) steps), so no weight
    is clipped; "absmax": GPTQ's and compressed-tensors' scale 2·max|w| / (2^b − 1), which clips the
    largest positive weight whenever it is the row's largest magnitude.
    """
    w = w.float()
    zeros_ = torch.zeros(w.shape[0], device=w.device)
    xmin = torch.minimum(w.min(dim=1).values, zeros_)
    xmax = torch.maximum(w.max(dim=1).values, zeros_)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -torch.ones_like(xmin), xmin)
    xmax = torch.where(empty, torch.ones_like(xmax), xmax)
    if spec.sym:
        half = (spec.maxq + 1) // 2
        if sym_range == "full":
            scale = torch.maximum(xmax / (half - 1), -xmin / half)
        else:
            scale = 2 * torch.maximum(-xmin, xmax) / spec.maxq
        zero = torch.full_like(scale, half)
    else:
        scale = (xmax - xmin) / spec.maxq
        zero = torch.round(-xmin / scale)
    return scale.unsqueeze(1), zero.unsqueeze(1)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) in [0, maxq].  Shapes broadcast: w (out, k), scale/zero (out, 1)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale * (q - zero)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return dequantize(quantize(w, scale, zero, maxq), scale, zero)


@dataclass
class QuantizedWeight:
    """The artifact between a solver (RTN, GPTQ, AWQ) and a packer: codes plus per-group parameters.

    q: (out, in) int32 codes in [0, 2^bits − 1]; scales: (out, groups) float32;
    zeros: (out, groups) int32; g_idx: (in,) int32 group of each input column.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    spec: QuantSpec

    def dequantize(self, rows: int = 1024) -> torch.Tensor:
        """(out, in) float32 weight, s · (q − z), a block of rows at a time: the per-column scales and zeros
        expanded over the whole matrix took four weight-sized temporaries (0.9 GB for an 8B model's
        down_proj, the streamed GPTQ layer's memory peak)."""
        g = self.g_idx.long()
        out = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        for i in range(0, out.shape[0], rows):
            r = slice(i, i + rows)
            torch.sub(self.q[r].float(), self.zeros[r][:, g].float(), out=out[r])
            out[r].mul_(self.scales[r][:, g])
        return out

    def split_rows(self, sizes: list[int]) -> list[QuantizedWeight]:
        """The weights of linears solved as one stacked weight (rows concatenated, one input), as views
        of `sizes[i]` consecutive rows each; g_idx and spec are shared (rows are independent)."""
        return [QuantizedWeight(q, scales, zeros, self.g_idx, self.spec)
                for q, scales, zeros in zip(self.q.split(sizes), self.scales.split(sizes), self.zeros.split(sizes))]


def keep_codes(qw: QuantizedWeight, name: str) -> dict[str, torch.Tensor]:
    """`qw` as a stage keeps it between steps, "<name>.<field>" tensors on the CPU, each with its own storage
    (row slices share the stacked one): codes and zeros as uint8 (a quarter of int32), codes two to a byte up to
    4 bits (an eighth). The kept codes of every layer done so far are alive at the end of calibration, its
    memory peak."""
    q = qw.q.to(torch.uint8)
    if qw.spec.bits <= 4 and q.shape[1] % 2 == 0:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    fields = {"q": q, "scales": qw.scales, "zeros": qw.zeros.to(torch.uint8), "g_idx": qw.g_idx}
    return {f"{name}.{k}": v.cpu().clone() for k, v in fields.items()}


class KeptCodes(Mapping[str, QuantizedWeight]):
    """{full module name: QuantizedWeight} over the tensors `keep_codes` kept, `names` giving each module's kept
    name and spec, built on access: the exporter packs one module at a time, so the unpacked codes of one module
    at a time are alive, not those of the whole model next to their packed copies (export is the run's memory
    peak). Codes and zeros stay uint8 (the packers accept any integer dtype): int32 codes of the whole model
    would cost as much memory as its float32 weights."""

    def __init__(self, kept: Mapping[str, torch.Tensor], names: dict[str, tuple[str, QuantSpec]]) -> None:
        self._kept, self._names = kept, names

    def __getitem__(self, key: str) -> QuantizedWeight:
        name, spec = self._names[key]
        q, g_idx = self._kept[f"{name}.q"], self._kept[f"{name}.g_idx"]
        if q.shape[1] != g_idx.numel():  # two codes to a byte: (out, in) again
            q = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)
        return QuantizedWeight(q, self._kept[f"{name}.scales"], self._kept[f"{name}.zeros"], g_idx, spec)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def group_index(columns: int, spec: QuantSpec) -> torch.Tensor:
    if spec.group_size == -1:
        return torch.zeros(columns, dtype=torch.int32)
    return (torch.arange(columns) // spec.group_size).to(torch.int32)


def rtn_quantize(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest with min-max ranges per group.  w: (out, in)."""
    out_f, in_f = w.shape
    g_idx = group_index(in_f, spec)
    n_groups = spec.groups(in_f)
    width = in_f if spec.group_size == -1 else spec.group_size
    scales = torch.empty(out_f, n_groups, device=w.device)
    zeros = torch.empty(out_f, n_groups, device=w.device)
    q = torch.empty(out_f, in_f, device=w.device)
    for g in range(n_groups):
        cols = slice(g * width, min((g + 1) * width, in_f))
        s, z = qparams(w[:, cols], spec)
        scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
        q[:, cols] = quantize(w[:, cols].float(), s, z, spec.maxq)
    return QuantizedWeight(q.to(torch.int32), scales, zeros.to(torch.int32), g_idx.to(w.device), spec)
