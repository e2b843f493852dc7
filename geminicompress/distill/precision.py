"""Which precision the distillation loop computes in: `precision: auto` (the default) resolved per device.

bf16 autocast halves the bytes every matmul reads and, where the hardware multiplies bf16 natively, trains
1.6-2x the tokens per second (demo, 24-layer student, a CPU with AVX-512 BF16) with the same result per token
(protocol perplexity 47.227 in float32, 47.232 in bf16, after the same 24,576 tokens). Where bf16 is emulated
it is slower than float32 (0.87x on AVX-512 without BF16, 0.13x on AVX2; docs/distill.md, "Precision"), so
`auto` asks the device:
- a GPU that computes bf16 (Ampere and later): bf16;
- a CPU with AVX-512 BF16 or AMX: bf16;
- anything else: float32 ("no").
Under `accelerate launch`, bf16 or fp16 chosen in accelerate's config (ACCELERATE_MIXED_PRECISION) wins
over the device's guess (its "no" is the launcher's default, not a choice, so the device decides). An explicit
`no`, `bf16` or `fp16` is used as given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in and why (report.json, the progress line)."""

    mode: str  # "no" | "bf16" | "fp16": what accelerate's mixed_precision gets
    why: str
    slow: bool = False  # bf16 asked for where it is emulated (0.13x float32's tokens/s on AVX2)


def resolve_precision(requested: str, device_type: str, native_bf16: bool, launcher: str | None = None) -> Precision:
    """`requested` ("auto", "no", "bf16", "fp16") -> what to compute in on a `device_type` device that does
    (`native_bf16`) or does not multiply bf16 in hardware; `launcher`: accelerate's configured choice."""
    where = "this GPU" if device_type == "cuda" else f"this {device_type.upper()}"
    if requested == "auto" and launcher not in ("bf16", "fp16"):
        if native_bf16:
            return Precision("bf16", f"auto: {where} computes bf16 natively")
        return Precision("no", f"auto: {where} does not compute bf16 natively (it would be emulated, slower)")
    mode, why = (launcher, "auto: accelerate's config") if requested == "auto" else (requested, "as asked")
    if mode == "bf16" and not native_bf16:
        return Precision(mode, f"{why}; {where} does not compute bf16 natively: emulated, slower than float32", True)
    return Precision(mode, why)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware: a CUDA GPU that supports it; a CPU with AVX-512 BF16
    or AMX (torch's own CPU feature probe)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
    return False


def choose_precision(requested: str, device: torch.device) -> Precision:
    """`resolve_precision` for this machine and launcher."""
    return resolve_precision(requested, device.type, native_bf16(device), os.environ.get(LAUNCHER_ENV))


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
