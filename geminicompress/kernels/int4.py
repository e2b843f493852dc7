"""torch's int4 weight-only GEMM ("tinygemm") for the packed formats we write: GPTQ, AWQ, pack-quantized.

Our formats dequantize with unsigned codes and integer zero points (formats/dequant.py):

    w[o, j] = s[o, g(j)] · (q[o, j] − z[o, g(j)])                  q, z in [0, 2^b)

torch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`, and `_weight_int4pack_mm` on CUDA) holds codes
in [0, 16) and, per group of consecutive input columns, a scale S and a float offset Z around code 8:

    w[o, j] = S[k, o] · (q[o, j] − 8) + Z[k, o]                     scales_and_zeros (groups, out, 2) = [S, Z]

so S = s and Z = s · (8 − z) give the same weights (exactly up to the rounding of S and Z to the
activation dtype: bf16 on a CPU, where the kernel is vectorized only for bf16 activations).

What the kernel needs, and how we meet it:
- codes < 16: 2-, 3- and 4-bit codes fit (a 3-bit model then moves 4 bits per weight); 8-bit do not.
- groups of 32, 64, 128 or 256 consecutive input columns: a larger group (or per-channel, one group of
  `in` columns) is cut into kernel groups of the largest such size dividing every group, with the
  scale repeated (exact); act-order checkpoints (GPTQ `desc_act`, a permuted `g_idx`) get their input
  columns sorted by group, and the activations are permuted the same way at run time, as the
  ExLlama/Marlin kernels do.
- out features a multiple of 16 (CPU) / 8 (CUDA).

The kernel is made for decode: its time grows with the rows of activations about linearly (~4.5 us a row
for a 576x576 linear on one thread), so a long prefill is slower than a bf16 GEMM. From `PREFILL_ROWS`
rows on (a CPU whose packed layout we can read: `unpack_cpu`), `Int4Linear` dequantizes its weight once
per call, S·(q − 8) + Z in bf16, and runs one bf16 GEMM: no memory is kept for it, and decode stays on the
kernel (benchmarks/studies/serving/int4_prefill_bench.py measures the ways, docs/eval.md has the figures).

The math (`int4_layout`) is pure; `Int4Linear` is the module that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

KERNEL_GROUP_SIZES = (256, 128, 64, 32)
CODE_OFFSET = 8  # the kernel's codes are centred on 8
PREFILL_ROWS = 512  # from this many rows on, dequantize once per call and one bf16 GEMM (the crossover: 256-512 rows)
CPU_BLOCKS = (64, 32, 16)  # output rows per block of torch's CPU int4 packing (64 with AVX-512), tried in order


@dataclass
class Int4Layout:
    """A linear's weights in the kernel's terms (before packing for a device)."""

    codes: torch.Tensor  # (out, in) int32 in [0, 16), input columns in kernel order
    scales_and_zeros: torch.Tensor  # (in / group_size, out, 2) float32: [S, Z]
    group_size: int  # kernel group size: 32, 64, 128 or 256
    perm: torch.Tensor | None  # (in,) int64: kernel column i reads input column perm[i]; None when in order


def int4_layout(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                out_multiple: int = 16) -> Int4Layout | str:
    """The kernel layout of w = s·(q − z) (q (out, in), scales/zeros (out, G), g_idx (in,)), or the reason
    it cannot be held (one line, for the report)."""
    out_f, in_f = q.shape
    if bits > 4:
        return f"{bits}-bit codes do not fit torch's int4 kernel"
    if out_f % out_multiple:
        return f"{out_f} output features: torch's int4 kernel needs a multiple of {out_multiple}"
    g_idx = g_idx.to(torch.int64).cpu()
    counts = torch.bincount(g_idx, minlength=scales.shape[1])
    size = next((e for e in KERNEL_GROUP_SIZES if bool((counts % e == 0).all())), None)
    if size is None:
        sizes = sorted(set(counts.tolist()))
        return (f"groups of {', '.join(map(str, sizes[:3]))} columns: torch's int4 kernel needs groups of 32, 64, "
                "128 or 256 (or multiples of them)")
    perm = torch.argsort(g_idx, stable=True)  # (in,) columns sorted by group
    in_order = bool(torch.equal(perm, torch.arange(in_f)))
    group_of = g_idx[perm][::size]  # (in / size,) the checkpoint's group of each kernel group
    s = scales.float().cpu()[:, group_of]  # (out, K) with K = in / size
    z = zeros.float().cpu()[:, group_of]
    sz = torch.stack([s, s * (CODE_OFFSET - z)], dim=-1).transpose(0, 1).contiguous()  # (K, out, 2)
    codes = q.to(torch.int32).cpu()
    if not in_order:
        codes = codes[:, perm]
    return Int4Layout(codes.contiguous(), sz, size, None if in_order else perm)


def dequantize_layout(layout: Int4Layout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight the kernel computes with, input columns back in checkpoint order (for tests
    and checks): S·(q − 8) + Z with S, Z rounded to `dtype` as the kernel holds them."""
    sz = layout.scales_and_zeros.to(dtype).float()  # (K, out, 2)
    k = torch.arange(layout.codes.shape[1]) // layout.group_size
    w = sz[k, :, 0].t() * (layout.codes.float() - CODE_OFFSET) + sz[k, :, 1].t()  # (out, in) kernel order
    if layout.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, layout.perm] = w
    return out


def pack_for(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernel's packed weight on `device`. CPU: `_convert_weight_to_int4pack_for_cpu` of the int32
    codes -> uint8 (out, in/2). CUDA (written, never run here: no GPU): two codes per byte, then torch's
    tiled layout with the most inner k-tiles (8, 4 or 2) whose 16-column tiles divide `in`, as torchao does."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    tiles = next((t for t in (8, 4, 2) if codes.shape[1] % (t * 16) == 0), 2)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)  # (out, in/2)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)


def unpack_cpu(packed: torch.Tensor, out_f: int, in_f: int, block: int) -> torch.Tensor:
    """The codes (in, out) uint8 of a CPU-packed weight (out, in/2): blocks of `block` output rows, each byte
    holding output rows d (low nibble) and d + block/2 (high) of its block at one input column."""
    v = packed.view(out_f // block, in_f, block // 2)  # (nb, in, block/2)
    return torch.cat([v & 15, v >> 4], 2).permute(1, 0, 2).reshape(in_f, out_f)


def cpu_block(packed: torch.Tensor, codes: torch.Tensor) -> int | None:
    """The block size `unpack_cpu` reads `packed` with, checked against its codes (out, in); None when no
    block size reads it back (another torch's layout): then prefill stays on the kernel."""
    out_f, in_f = codes.shape
    for block in CPU_BLOCKS:
        if out_f % block == 0 and torch.equal(unpack_cpu(packed, out_f, in_f, block).t(), codes.to(torch.uint8)):
            return block
    return None


def dequantize_packed(packed: torch.Tensor, block: int, group_size: int, offsets: torch.Tensor, scales: torch.Tensor,
                      out_f: int, in_f: int) -> torch.Tensor:
    """Ŵᵀ (in, out) in the scales' dtype from the CPU-packed codes: q·S + (Z − 8·S), groups of input rows.
    scales, offsets: (in / group_size, out) = S and Z − 8·S."""
    q = unpack_cpu(packed, out_f, in_f, block).to(scales.dtype).view(in_f // group_size, group_size, out_f)
    return torch.addcmul(offsets.unsqueeze(1), q, scales.unsqueeze(1)).view(in_f, out_f)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ the packed weight^T -> (M, out), in x's dtype (which must be sz's)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)


class Int4Linear(nn.Module):
    """y = x Ŵᵀ + b through torch's int4 kernel; activations computed in `dtype` (bf16 on a CPU)."""

    def __init__(self, layout: Int4Layout, bits: int, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = layout.codes.shape
        self.bits, self.group_size = bits, layout.group_size
        self.register_buffer("packed", pack_for(layout.codes, device))
        self.register_buffer("scales_and_zeros", layout.scales_and_zeros.to(device=device, dtype=dtype))
        self.register_buffer("perm", None if layout.perm is None else layout.perm.to(device))
        self.block = cpu_block(self.packed, layout.codes) if device.type == "cpu" else None  # None: kernel only
        if self.block is not None:  # the prefill path's offsets Z − 8·S (out floats: (in / group_size, out))
            sz = self.scales_and_zeros.float()
            self.register_buffer("offsets", (sz[..., 1] - CODE_OFFSET * sz[..., 0]).to(dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device=device, dtype=dtype),
                                                           requires_grad=False)

    @property
    def kernel(self) -> str:
        return f"torch-int4-{self.packed.device.type}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)  # (M, in)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.block is not None and x2.shape[0] >= PREFILL_ROWS:  # prefill: dequantize once, one bf16 GEMM
            w_t = dequantize_packed(self.packed, self.block, self.group_size, self.offsets,
                                    self.scales_and_zeros[..., 0], self.out_features, self.in_features)
            y = x2 @ w_t  # (M, out)
        else:
            y = int4_mm(x2.contiguous(), self.packed, self.group_size, self.scales_and_zeros)  # (M, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, act_order={self.perm is not None}, bias={self.bias is not None}")
