"""INT8 linear modules that replace `nn.Linear`: weight-only (W8A16) and weights+activations (W8A8).

Both hold exactly what goes on disk, as buffers named like compressed-tensors' `int-quantized` layout:
`weight` int8 (out, in) and `weight_scale` float32 (out, 1) (plus `bias` when the linear had one),
so `state_dict()` is the checkpoint and `load_state_dict()` reads it back.

W8A8 runs on PyTorch's fbgemm dynamic quantized linear (`torch.ops.quantized.linear_dynamic`): INT8 x INT8
products with INT32 accumulation (AVX-512 VNNI where the CPU has it). That kernel quantizes its input
with one (asymmetric, uint8) range per call. We make the range per token: each row of X is mapped onto
[-1, 1] first (x = h·x̂ + m with m, h the row's mid-point and half-range) and the output is mapped back
(y = h·(x̂ Ŵ^T) + m·Σ_j Ŵ_ij). Each token therefore uses all 256 levels between its own min and max:
at least as fine as the symmetric per-token grid that `strategy: token` in the checkpoint asks for
(which is what vLLM's kernels use when serving the same file). Where fbgemm is unavailable
(a GPU tensor, a torch without quantized ops) a reference path computes the same quantities with
float matmuls on fake-quantized tensors.

W8A16 keeps activations in float; the int8 codes go through fbgemm's fp16-weight GEMM (exact for
integers up to 2048) and the per-row scale is applied to the (tokens, out) result rather than to the
(out, in) weight.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.core.rows import rows_within, spans
from geminicompress.kernels.int8_quant import dequantize, fake_quantize_tokens, quantize_weight

PACK_BYTES = 256 << 20  # float32 rows made at a time to pack a weight (or sum its rows) from


class Int8Base(nn.Module):
    """int8 `weight` (out, in) + float32 `weight_scale` (out, 1) + optional float `bias`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self._packed = None  # the kernel's packed weight, built from the buffers on first use
        self.shared = None  # (SharedInput, index) when siblings reading the same input run as one GEMM

    def _shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """This module's output from its sibling group's fused GEMM (shared_input.py), or None."""
        return None if self.shared is None else self.shared[0].output(self.shared[1], x)

    def _forget_packed(self) -> None:
        self._packed = None
        if self.shared is not None:
            self.shared[0].reset()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._forget_packed()  # new codes: repack on next call
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._forget_packed()
        return super()._apply(fn, recurse)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale_dtype: torch.dtype = torch.float32) -> "Int8Base":
        """The INT8 module of `linear`, its scales rounded to `scale_dtype` before the codes are chosen
        (float16 for GGUF's Q8_0, which stores them so)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        q, scale = quantize_weight(linear.weight.data, scale_dtype=scale_dtype)
        module.weight.copy_(q)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.data)
        return module.to(linear.weight.device)

    def packed_only(self) -> "Int8Base":
        """Pack the kernel's weight now and drop the int8 codes this module would pack from (for a run-time
        module nobody saves, such as a fused sibling group: the codes stay in the members). No-op where
        the forward reads the codes themselves (no fbgemm)."""
        if fbgemm_available() and self.weight.device.type == "cpu":
            self._prepare()
            self.weight = torch.empty(0, dtype=torch.int8)
        return self

    def _prepare(self) -> None:
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightOnlyLinear(Int8Base):
    """W8A16: y = (x @ q^T) * scale^T + b with float activations.

    On CPU the int8 codes are packed once into fbgemm's fp16 GEMM (`linear_dynamic_fp16`): integers in
    [-127, 127] are exact in fp16, the kernel widens them to fp32 in registers and keeps x in fp32, so
    the result equals the float matmul with the dequantized weight while streaming 2 bytes per weight
    instead of 4. Elsewhere the codes are converted to x's dtype per call."""

    @property
    def kernel(self) -> str:
        return "fbgemm-fp16-codes" if fbgemm_available() else "dequant-matmul"

    def _prepare(self) -> None:
        """One fp16 pack per block of PACK_BYTES of float32 rows (the kernel packs from float32): a linear of
        up to 64 M weights is one pack; a 262,144 x 4,096 head is 16, packed without its 4 GiB float32 copy."""
        rows = rows_within(self.in_features, PACK_BYTES)
        self._packed = [(start, stop, torch.ops.quantized.linear_prepack_fp16(self.weight[start:stop].float(), None))
                        for start, stop in spans(self.out_features, rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._shared_output(x)) is not None:
            return y
        if x.device.type == "cpu" and fbgemm_available():
            if self._packed is None:
                self._prepare()
            x32 = x.float()
            if len(self._packed) == 1:
                y = torch.ops.quantized.linear_dynamic_fp16(x32, self._packed[0][2])
            else:  # each output column from its own row's pack: the same values as one pack's
                y = x32.new_empty(*x.shape[:-1], self.out_features)
                for start, stop, packed in self._packed:
                    y[..., start:stop] = torch.ops.quantized.linear_dynamic_fp16(x32, packed)
            y = y.to(x.dtype)  # (..., out)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        y = y * self.weight_scale.view(-1).to(x.dtype)
        return y + self.bias if self.bias is not None else y


class W8A8Linear(Int8Base):
    """W8A8: int8 per-channel weights, int8 per-token dynamic activations, INT8 GEMM on CPU (fbgemm)."""

    @property
    def kernel(self) -> str:
        return "fbgemm-dynamic" if fbgemm_available() else "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._shared_output(x)) is not None:
            return y
        if x.device.type != "cpu" or not fbgemm_available():
            return self.reference_forward(x)
        if self._packed is None:
            self._prepare()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # (tokens, in)
        if x2.shape[0] == 1:  # one token: the kernel's per-tensor range is already this token's range
            y = torch.ops.quantized.linear_dynamic(x2, self._packed, _reduce_range())
        else:  # map every token onto [-1, 1] so the kernel's one range is each token's own range
            lo, hi = x2.aminmax(dim=1, keepdim=True)  # (tokens, 1)
            mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
            y = torch.ops.quantized.linear_dynamic((x2 - mid) / half, self._packed, _reduce_range())
            y = torch.addcmul(mid * self._sums, y, half)  # x = half·x̂ + mid: y = half·(x̂ W^T) + mid·ΣW
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def _prepare(self) -> None:
        """The packed weight and Σ_j Ŵ_ij of the dequantized weight, (1, out), made together."""
        self._packed = pack_weight(self.weight, self.weight_scale)
        rows = rows_within(self.in_features, PACK_BYTES)  # each row's sum from its own float32 row: no whole copy
        self._sums = torch.cat([dequantize(self.weight[a:b], self.weight_scale[a:b]).sum(dim=1)
                                for a, b in spans(self.out_features, rows)]).unsqueeze(0)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same math with float matmuls: fake-quantized tokens times the dequantized weight."""
        y = F.linear(fake_quantize_tokens(x.float()), self.dequantized_weight(torch.float32)).to(x.dtype)
        return y + self.bias if self.bias is not None else y


# --------------------------------------------------------------------------- fbgemm plumbing


@functools.lru_cache(maxsize=1)
def fbgemm_available() -> bool:
    """True when this torch has the quantized CPU ops and an x86/fbgemm engine."""
    engines = torch.backends.quantized.supported_engines
    return hasattr(torch.ops.quantized, "linear_dynamic") and ("x86" in engines or "fbgemm" in engines)


@functools.lru_cache(maxsize=1)
def _reduce_range() -> bool:
    """fbgemm's non-VNNI kernels sum u8·s8 pairs in int16 and can saturate; 7-bit activations avoid
    that. CPUs with AVX-512 VNNI / AVX-VNNI accumulate in int32 and keep the full 8 bits."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return not ("avx512_vnni" in flags or "avx_vnni" in flags)


@contextmanager
def _engine(name: str) -> Iterator[None]:
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def pack_weight(q: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed per-channel int8 weight.  q: (out, in) int8, scale: (out, 1)."""
    engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings(), _engine(engine):
        warnings.simplefilter("ignore")  # quantized-tensor constructors are deprecated but still the CPU path
        qw = torch._make_per_channel_quantized_tensor(q.cpu(), scale.view(-1).double().cpu(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qw, None)


MODULES: dict[str, type[Int8Base]] = {"int8": Int8WeightOnlyLinear, "w8a8": W8A8Linear}
