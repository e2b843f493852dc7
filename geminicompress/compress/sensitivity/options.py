"""Candidate settings of a sensitivity table: parse `gptq:b4g64,rtn:b3g128,magnitude:0.5,...`, apply one to
a weight, and say what it costs.

Labels: `gptq:b<bits>g<group>` and `rtn:b<bits>g<group>` (group -1 = per channel; GPTQ needs the layer's
Hessian), `magnitude:<s>` (alias `prune:<s>`), `wanda:<s>` (needs input norms) and `sparsegpt:<s>` (needs the
Hessian): sparsity s in (0, 1); `gguf:<TYPE>` (Q2_K ... Q8_0, IQ4_NL: a GGUF tensor type, rounded as
llama-quantize rounds it with the layer's Hessian diagonal as its importance matrix; `--gguf-type auto`).
Cost per weight: quantized = bits + (16-bit scale + bits-wide zero) per group, as the gptq format stores them;
a GGUF type = its block's bytes x 8 / its block's weights; pruned = the kept fraction (1 − s). A GGUF type whose
block does not divide a linear's inputs does not apply to it (its drift is NaN: the allocation skips it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from geminicompress.compress.gptq.solver import gptq_quantize
from geminicompress.compress.prune.masks import row_mask, tensor_mask
from geminicompress.compress.prune.sparsegpt import sparsegpt_prune
from geminicompress.compress.prune.wanda import wanda_scores
from geminicompress.core.grid import QuantSpec, rtn_quantize
from geminicompress.core.errors import InputError
from geminicompress.formats import gguf_blocks

QUANT = ("gptq", "rtn")
PRUNE = ("magnitude", "wanda", "sparsegpt")
GGUF = "gguf"
# the per-tensor GGUF types `--gguf-type auto` may give (a row's block must divide it; the mins of Q4_1/Q5_1
# are left out: their 32-blocks cost what Q5_0/IQ4_NL do for less)
GGUF_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q5_0", "Q8_0")
_QUANT_RE = re.compile(r"^b(\d+)g(-?\d+)$")


@dataclass(frozen=True)
class Option:
    label: str
    method: str  # gptq | rtn | magnitude | wanda | sparsegpt
    spec: QuantSpec | None = None
    sparsity: float | None = None
    gguf_type: str | None = None  # gguf options: the tensor type

    @property
    def quantizes(self) -> bool:
        return self.spec is not None or self.gguf_type is not None

    @property
    def needs_hessian(self) -> bool:
        return self.method in ("gptq", "sparsegpt", GGUF)

    def applies(self, in_features: int) -> bool:
        """Whether the option can hold a linear of `in_features` inputs (a GGUF type: its block divides it)."""
        return self.gguf_type is None or in_features % gguf_blocks.block_size(self.gguf_type) == 0

    def bits_per_weight(self, in_features: int) -> float:
        """Stored bits per weight, scales and zero points included (quantize options)."""
        if self.gguf_type is not None:
            return gguf_blocks.bits_per_weight(self.gguf_type)
        assert self.spec is not None
        group = in_features if self.spec.group_size == -1 else self.spec.group_size
        return self.spec.bits + (16 + self.spec.bits) / group

    def kept(self) -> float:
        return 1.0 if self.sparsity is None else 1.0 - self.sparsity


def parse_option(text: str) -> Option:
    method, _, arg = text.strip().partition(":")
    method = "magnitude" if method == "prune" else method
    if method in QUANT:
        m = _QUANT_RE.match(arg)
        if not m:
            raise InputError(f"option '{text}': write {method}:b<bits>g<group size>, e.g. {method}:b4g64")
        bits, group = int(m.group(1)), int(m.group(2))
        if group == 0 or group < -1:
            raise InputError(f"option '{text}': group size must be positive or -1 (per channel), got {group}")
        return Option(f"{method}:b{bits}g{group}", method, spec=QuantSpec(bits, group, True))
    if method == GGUF:
        gtype = arg.strip().upper()
        if gtype not in GGUF_TYPES:
            raise InputError(f"option '{text}': a GGUF tensor type is one of {', '.join(GGUF_TYPES)}")
        return Option(f"{GGUF}:{gtype}", GGUF, gguf_type=gtype)
    if method in PRUNE:
        try:
            s = float(arg)
        except ValueError:
            s = -1.0
        if not 0.0 < s < 1.0:
            raise InputError(f"option '{text}': write {method}:<sparsity> with a sparsity in (0, 1), e.g. {method}:0.5")
        return Option(f"{method}:{s:g}", method, sparsity=s)
    raise InputError(f"option '{text}': unknown method '{method}' (known: {', '.join(QUANT + PRUNE)}, gguf, prune)")


def parse_options(text: str) -> list[Option]:
    options = [parse_option(t) for t in text.split(",") if t.strip()]
    if not options:
        raise InputError("--options names no option (e.g. gptq:b4g64,gptq:b3g64)")
    labels = [o.label for o in options]
    if len(set(labels)) != len(labels):
        raise InputError(f"--options repeats an option: {', '.join(labels)}")
    return options


def check_applicable(options: list[Option], in_features: dict[str, int]) -> None:
    """An impossible group size (not dividing some module's inputs) is an input error, before any work."""
    for o in options:
        if o.spec is None:
            continue
        for name, cols in in_features.items():
            if not o.spec.whole_groups(cols):
                raise InputError(f"option '{o.label}': group size {o.spec.group_size} does not divide the {cols} "
                                 f"input features of {name}")


def apply_option(W: torch.Tensor, option: Option, H: torch.Tensor | None, norms: torch.Tensor | None,
                 act_order: bool = True) -> torch.Tensor:
    """The weight (out, in) after `option` alone: fake-quantized or pruned (float32). `act_order`: GPTQ's
    column order (the gptq stage's default, so the table measures what the stage will do)."""
    W = W.detach().float()
    if option.method == GGUF:  # llama-quantize's rounding, the Hessian's diagonal as its importance
        importance = None if H is None else torch.diagonal(H).float().clamp_min(0).numpy()
        return gguf_blocks.dequantize(gguf_blocks.rtn_bytes(W.numpy(), option.gguf_type, importance), option.gguf_type)
    if option.method == "gptq":
        return gptq_quantize(W, H, option.spec, act_order=act_order)[0].dequantize()
    if option.method == "rtn":
        return rtn_quantize(W, option.spec).dequantize()
    if option.method == "magnitude":
        return W * tensor_mask(W.abs(), option.sparsity)
    if option.method == "wanda":
        return W * row_mask(wanda_scores(W, norms), option.sparsity)
    return sparsegpt_prune(W, H, option.sparsity)[0].float()
