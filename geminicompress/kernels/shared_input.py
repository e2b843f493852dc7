"""Sibling INT8 linears that read the same input (q/k/v after the input norm, gate/up after the
post-attention norm) run as one GEMM.

Why: at batch 1 a decode step multiplies one token by each weight, and fbgemm's dynamic INT8 linear
then costs mostly its fixed per-call work (quantize the token, pick the kernel, requantize the output):
on the demo model about 20 µs per call whatever the shape, from 192x576 (16 µs) to 3072x576 (25 µs),
measured on the 2-core CPU of docs/int8.md. Fusing q/k/v into one call and gate/up into one saves three
of the seven calls per decoder layer. This is what serving engines do (vLLM's QKVParallelLinear and
MergedColumnParallelLinear); here it happens at run time only: the checkpoint keeps one tensor per linear.

How, without touching the model's own forward code: the first member called with an input computes the
fused output for every member, returns its slice and keeps the others; a sibling called next with the
*same* tensor object (same version counter: not modified in place since; under torch.inference_mode,
whose tensors keep no version counter, the same object) takes its slice from there.
Anything else (another input, a member called twice) falls back to the member's own GEMM. Results are
those of the separate GEMMs: each token's activation range, hence its INT8 grid, is the same for every
member, and each output channel is computed from its own weight row (tested to be equal).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for, get_module
from geminicompress.core.errors import InputError
from geminicompress.kernels.int8 import Int8Base


class SharedInput:
    """One group of sibling modules (same class, same in_features) and the fused module they share."""

    def __init__(self, members: list[Int8Base]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._fused: Int8Base | None = None
        self._x: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = []

    def reset(self) -> None:
        """Forget the fused weights (after the members' weights changed or moved) and any kept outputs."""
        self._fused, self._x, self._outputs = None, None, []

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for input x, or None when the member must compute it alone."""
        if x.requires_grad:
            return None
        version = -2 if x.is_inference() else x._version  # inference tensors keep no version counter
        if self._x is x and version == self._version and self._outputs[index] is not None:
            y, self._outputs[index] = self._outputs[index], None
            if all(o is None for o in self._outputs):
                self._x = None  # every sibling served: release the input and the outputs
            return y
        fused = self._fused if self._fused is not None else self._build()
        outputs = list(fused(x).split(self.sizes, dim=-1))
        y, outputs[index] = outputs[index], None
        self._x, self._version, self._outputs = x, version, outputs
        return y

    def _build(self) -> Int8Base:
        first = self.members[0]
        has_bias = first.bias is not None
        fused = type(first)(first.in_features, sum(self.sizes), has_bias,
                            first.bias.dtype if has_bias else torch.float32)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in self.members]))
            fused.weight_scale.copy_(torch.cat([m.weight_scale for m in self.members]))
            if has_bias:
                fused.bias = torch.cat([m.bias for m in self.members])
        self._fused = fused.to(first.weight.device).packed_only()  # the codes stay in the members only
        return self._fused


def share_inputs(model: nn.Module) -> int:
    """Group the INT8 linears of `model` that read one input (from the architecture table's groups fed
    by a norm). Returns the number of groups made; 0 for a model without decoder layers found."""
    if getattr(model, "config", None) is None:
        return 0
    try:
        arch = arch_for(model)
    except InputError:  # no decoder layers found
        return 0
    try:
        layers = get_module(model, arch.layers)
    except AttributeError:
        return 0
    made = 0
    for i in range(len(layers)):
        for group in arch.smooth:
            if len(group.linears) < 2:
                continue
            try:
                members = [get_module(model, f"{arch.layers}.{i}.{name}") for name in group.linears]
            except AttributeError:
                continue
            if not _can_share(members):
                continue
            shared = SharedInput(members)
            for index, member in enumerate(members):
                member.shared = (shared, index)
            made += 1
    return made


def _can_share(members: list[nn.Module]) -> bool:
    first = members[0]
    return (isinstance(first, Int8Base)
            and all(type(m) is type(first) and m.in_features == first.in_features for m in members)
            and len({m.bias is None for m in members}) == 1
            and len({m.weight.device for m in members}) == 1)
