"""Which kernel runs a loaded model's linears on this device, and swapping the fast ones in (STYLE rule 16:
time what users run, never our reference loader).

After loading, a packed model's quantized linears are `DequantLinear`s: they rebuild the float weight on
every call, which is exact but says nothing about speed (issue #25: 13x "slower" 4-bit GPTQ). Here:

| what was loaded | kernel on a CPU | kernel on CUDA (not run here: no GPU) |
|---|---|---|
| GPTQ / AWQ / pack-quantized, 2-4 bit | torch's int4 kernel, bf16 activations (int4.py); on an AMD CPU one token's attention in float32 (decode_attention.py) | torch's int4 kernel (tinygemm), bf16 |
| the same, 8-bit symmetric per channel | fbgemm's W8A16 kernel (the int8 module) | none: not timed |
| the same, other 8-bit | dense weights dequantized once (the rest on its kernels): quality only, latency not measured | same |
| a 2-4 bit shape the kernel cannot hold | none: latency not measured, the reason shown | same |
| int8 / w8a8 (compressed-tensors int-quantized) | fbgemm (kernels/int8.py, as loaded) | reference matmuls |
| dense | torch's matmul in the stored dtype; float32 on an AMD CPU routed by rows (cpu_dense.py): 2-4 as (W·Xᵀ)ᵀ, the rest through oneDNN | torch's matmul |
| dense with pruned zeros | dense matmul, noted: unstructured sparsity / 2:4 has no kernel here | 2:4: sparse tensor cores, not used |

The int4 kernel is vectorized on x86 only for bf16 activations, so a model that uses it runs in bf16
(its norms, embeddings and head too); `eval` then also times the baseline in bf16 (api.py), so the two
are compared at the same activation dtype. On CUDA the formats' own serving kernels (Marlin, ExLlama) are
what `eval --engine vllm` measures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from geminicompress.formats.dequant import DequantLinear
from geminicompress.kernels.int4 import Int4Linear, int4_layout
from geminicompress.kernels.cpu_dense import cpu_dense
from geminicompress.kernels.decode_attention import use_decode_attention
from geminicompress.kernels.int8 import Int8WeightOnlyLinear

SPARSE_NOTE = "unstructured sparsity runs dense here: no sparse kernel on this device"
SPARSE_24_NOTE = "2:4 sparsity runs dense here: it needs sparse tensor cores (a GPU)"
SPARSE_MIN = 0.1  # a dense model with at least this fraction of zero weights counts as pruned
SLOW_FALLBACKS = ("reference", "dequant-matmul")  # the int8 modules' names for their float imitation
# the activations of torch's int4 kernel: bf16, where it is fast (x86 CPUs: vectorized for bf16 only; CUDA: bf16 only)
INT4_ACTIVATION_DTYPE = torch.bfloat16


@dataclass
class KernelChoice:
    """What runs the model's linears: recorded in report.json (`kernel`) and shown in the table."""

    kernel: str  # "torch-int4-cpu", "fbgemm-int8", "dense", "reference" ...
    activation_dtype: str  # what the activations are computed in
    modules: dict[str, int] = field(default_factory=dict)  # kernel -> number of linears
    timed: bool = True  # False: only the reference path exists here; latency is not measured
    note: str | None = None  # why (no fast kernel, sparsity that runs dense)


def expects_int4(config: dict | None) -> bool:
    """From a config.json alone: would this checkpoint run on the int4 kernel (so in bf16)?"""
    qc = (config or {}).get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return int(qc.get("bits", 4)) <= 4
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        groups = (qc.get("config_groups") or {}).values()
        return all(int((g.get("weights") or {}).get("num_bits", 8)) <= 4 for g in groups)
    return False


def _sparsity_note(model: nn.Module, sparsity: float | None) -> str | None:
    if sparsity is None or sparsity < SPARSE_MIN:
        return None
    return SPARSE_24_NOTE if _is_24(model) else SPARSE_NOTE


def _is_24(model: nn.Module) -> bool:
    """Every decoder linear has at least 2 zeros in each group of 4 consecutive inputs."""
    found = False
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, nn.Linear) or name.endswith("lm_head") or w.shape[1] % 4:
            continue
        found = True
        if bool(((w.view(-1, 4) == 0).sum(-1) < 2).any()):
            return False
    return found


@torch.no_grad()
def use_fast_kernels(model: nn.Module, device: torch.device, sparsity: float | None = None,
                     reference: bool = False) -> KernelChoice:
    """Swap every `DequantLinear` for the device's fast kernel when all of them can take it (then the
    whole model computes in the kernel's activation dtype), and on an AMD CPU route the dense float32 linears by
    their rows (cpu_dense.py) and a bfloat16 model's one-token attention through decode_attention.py (elsewhere
    torch's own are faster: cpu_vendor.py); say what runs. The model is changed in place.
    With `reference` (`eval --kernels reference`) nothing is swapped: what runs is packed formats through our
    dequantizing loader (exact, not timed), the rest as loaded."""
    choice = _swap_packed(model, device, sparsity, reference)
    if device.type == "cpu" and not reference:
        cpu_dense(model)
        if choice.activation_dtype == "bfloat16":  # one token's attention: decode_attention.py
            use_decode_attention(model)
    return choice


def _swap_packed(model: nn.Module, device: torch.device, sparsity: float | None, reference: bool) -> KernelChoice:
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, DequantLinear)]
    if not packed:
        return _unpacked(model, device, sparsity)
    dtype = next(model.parameters()).dtype
    if reference:
        return KernelChoice("reference", dtype_name(dtype), {"reference": len(packed)}, False,
                            "reference path (--kernels reference): packed weights are dequantized on every call")
    plans: dict[str, object] = {}  # name -> INT8 (fbgemm W8A16), DENSE, or the int4 kernel's layout
    for name, m in packed:
        plan = INT8 if _is_int8_channel(m, device) else int4_layout(m.q, m.scales, m.zeros, m.g_idx, m.bits,
                                                                   16 if device.type == "cpu" else 8)
        if isinstance(plan, str) and plan != INT8 and m.bits > 4:
            plan = DENSE  # 8-bit with groups or zero points: no kernel; its weights dequantized once
        elif isinstance(plan, str) and plan != INT8:
            return KernelChoice("reference", dtype_name(dtype), {"reference": len(packed)}, False,
                                f"no fast kernel on {device.type}: {name}: {plan}")
        plans[name] = plan
    int4 = [n for n, p in plans.items() if p not in (INT8, DENSE)]
    act = INT4_ACTIVATION_DTYPE if int4 else dtype
    model.to(act)  # norms, embeddings, head: the kernel's activation dtype
    counts: dict[str, int] = {}
    for name, m in packed:
        plan = plans[name]
        module = (_int8_module(m, act) if plan == INT8 else _dense_module(m, act) if plan == DENSE
                  else Int4Linear(plan, m.bits, m.bias, act, device))
        kernel = getattr(module, "kernel", DENSE)
        counts[kernel] = counts.get(kernel, 0) + 1
        model.set_submodule(name, module)
    bits = sorted({m.bits for n, m in packed if n in int4})
    note = (f"{'/'.join(map(str, bits))}-bit codes run in the int4 kernel (4 bits per weight in memory)"
            if bits and bits != [4] else None)
    if DENSE in counts:  # quality through the kernels (fast), speed not: the dense ones are not the format's
        return KernelChoice(max(counts, key=counts.get), dtype_name(act), counts, False,
                            f"{counts[DENSE]} 8-bit linears with groups or zero points have no kernel on "
                            f"{device.type}: they run as dense {dtype_name(act)} weights dequantized once")
    return KernelChoice(max(counts, key=counts.get), dtype_name(act), counts, True, note)


INT8 = "int8"
DENSE = "dense-dequantized"


def _dense_module(m: DequantLinear, dtype: torch.dtype) -> nn.Linear:
    """A plain linear holding m's dequantized weights in `dtype` (the same weights; 8-bit codes that no kernel
    here takes, so that a mixed model's other linears still run on theirs)."""
    module = nn.Linear(m.in_features, m.out_features, m.bias is not None, device="meta")
    module.weight = nn.Parameter(m.weight.to(dtype), requires_grad=False)
    if m.bias is not None:
        module.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
    return module


def _is_int8_channel(m: DequantLinear, device: torch.device) -> bool:
    """8-bit symmetric per-channel codes (zero point 128, one group): int8 W8A16 weights for fbgemm."""
    return (m.bits == 8 and device.type == "cpu" and m.scales.shape[1] == 1 and bool((m.zeros == 128).all())
            and bool(torch.equal(m.g_idx, torch.zeros_like(m.g_idx))))


def _int8_module(m: DequantLinear, dtype: torch.dtype) -> Int8WeightOnlyLinear:
    """The same weights as fbgemm's W8A16 module: codes q − 128 in [-128, 127], the same scales (exact)."""
    module = Int8WeightOnlyLinear(m.in_features, m.out_features, m.bias is not None, dtype)
    module.weight.copy_((m.q.to(torch.int16) - 128).to(torch.int8))
    module.weight_scale.copy_(m.scales.float())
    if m.bias is not None:
        module.bias.copy_(m.bias.detach())
    return module


def _unpacked(model: nn.Module, device: torch.device, sparsity: float | None) -> KernelChoice:
    """A model without packed linears: dense matmuls and/or the int8 modules' own kernels."""
    dtype = next(model.parameters()).dtype
    counts = dict(Counter(k for k in (getattr(m, "kernel", None) for m in model.modules()) if isinstance(k, str)))
    dense = sum(isinstance(m, nn.Linear) for m in model.modules())
    if dense:
        counts["dense"] = dense
    name = next((k for k in counts if k != "dense"), "dense")
    if name in SLOW_FALLBACKS:  # int8 modules off the CPU: float matmuls that imitate the kernel
        return KernelChoice(name, dtype_name(dtype), counts, False,
                            f"no int8 kernel on {device.type} here (vLLM's: --engine vllm)")
    return KernelChoice(name, dtype_name(dtype), counts, True, _sparsity_note(model, sparsity))


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name report.json and the table use."""
    return str(dtype).removeprefix("torch.")
