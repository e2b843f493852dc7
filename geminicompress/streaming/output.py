"""The on-disk format of a streamed run, one decoder layer at a time: which tensors a finished layer
writes, how a resumed calibrated run reads them back into the layer, and config.json at the end.

One class per kind of format, each calling the format module's own pack and config functions (the ones
its in-memory `write` calls), so that the streamed and in-memory checkpoints hold the same tensors and
the same config:
- `DenseOutput`: the layer's tensors as they are (the dense checkpoint; also the fake-quantized weights of
  a b-bit method with `--format dense`);
- `Int8Output`: compressed-tensors int-quantized (the INT8 modules' own state dicts);
- `PackedOutput`: a b-bit format (gptq, awq, compressed-tensors pack-quantized) packed from the codes the
  stage kept for the layer;
- `SparseOutput`: compressed-tensors sparse-bitmask (or its 2:4 variant) from the stage's keep-masks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from geminicompress.compress.grid import QuantizedWeight, QuantSpec
from geminicompress.formats.checkpoint import float_linears, write_config
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.streaming.sink import module_tensors

LoadBack = Callable[[int, nn.Module, dict[str, torch.Tensor]], None]


class DenseOutput:
    """Every tensor of the layer in the output dtype; config.json with `qconfig` (None: a dense checkpoint)."""

    format = "dense"

    def __init__(self, ckpt: LazyCheckpoint, dtype: torch.dtype) -> None:
        self.ckpt, self.dtype = ckpt, dtype

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return module_tensors(self.ckpt.layer_prefix(i), layer, self.dtype)

    def dense(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A finished layer's written tensors as the dense state dict of the layer (names relative to it)."""
        prefix = self.ckpt.layer_prefix(i) + "."
        return {k[len(prefix):]: v for k, v in tensors.items()}

    @torch.no_grad()
    def load_back(self, i: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put a finished layer's written tensors back into it (to compute the next layer's inputs on resume)."""
        state = layer.state_dict(keep_vars=True)
        for name, value in self.dense(i, tensors).items():
            state[name].data.copy_(value.to(state[name].dtype))

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def write_config(self, out: Path, result: dict[str, Any]) -> None:
        """config.json (+ the format's files beside it); `result`: the writing stage's result for report.json."""
        write_config(self.ckpt.model, out, self.qconfig(result), self.dtype)


class Int8Output(DenseOutput):
    """compressed-tensors int-quantized: the layer's INT8 modules write their codes and scales themselves."""

    format = "compressed-tensors:int-quantized"

    def __init__(self, ckpt: LazyCheckpoint, dtype: torch.dtype, method: str, targets: list[str]) -> None:
        super().__init__(ckpt, dtype)
        self.method, self.targets = method, set(targets)

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        from geminicompress.formats.int_quantized import quantization_config

        return quantization_config(self.method, [n for n in float_linears(self.ckpt.model) if n not in self.targets])


class PackedOutput(DenseOutput):
    """A b-bit format: each quantized linear's weight replaced by `pack(qw)` of the codes the stage kept
    (`qweights(i, kept)`: {full module name: QuantizedWeight} of layer i)."""

    def __init__(self, ckpt: LazyCheckpoint, dtype: torch.dtype, fmt: str, spec: QuantSpec, targets: list[str],
                 meta: dict[str, Any], qweights: Callable[[int, dict[str, torch.Tensor]], Mapping[str, QuantizedWeight]]) -> None:
        from geminicompress.formats import awq, gptq, pack_quantized

        super().__init__(ckpt, dtype)
        self.format = "compressed-tensors:pack-quantized" if fmt == "compressed-tensors" else fmt
        self.fmt, self.spec, self.targets, self.meta, self.qweights = fmt, spec, targets, meta, qweights
        self.pack, self.suffixes, self.unpack = {
            "gptq": (gptq.pack_gptq, gptq.SUFFIXES, lambda t: gptq.unpack_gptq(t, spec)),
            "awq": (awq.pack_awq, awq.SUFFIXES, lambda t: awq.unpack_awq(t, spec)),
            "compressed-tensors": (pack_quantized.packer(meta), pack_quantized.SUFFIXES,
                                   lambda t: pack_quantized.unpack_ct(t, spec)),
        }[fmt]

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        qweights = self.qweights(i, kept)
        prefix = self.ckpt.layer_prefix(i)
        # the packed linears' float weights are not cast only to be dropped (0.41 GB for an 8B layer in bf16)
        tensors = module_tensors(prefix, layer, self.dtype,
                                 frozenset(f"{n.removeprefix(prefix + '.')}.weight" for n in qweights))
        for name in qweights:  # one module's unpacked codes alive at a time
            tensors.update({f"{name}.{k}": v.cpu() for k, v in self.pack(qweights[name]).items()})
        return tensors

    def dense(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Quantized linears dequantized: the same float32 weights the run computed with, since the scales
        were rounded to the stored dtype before the weights were."""
        tensors = dict(tensors)
        prefix = self.ckpt.layer_prefix(i) + "."
        for name in [n for n in self.targets if n.startswith(prefix)]:
            parts = {k: tensors.pop(f"{name}.{k}") for k in self.suffixes if f"{name}.{k}" in tensors}
            tensors[f"{name}.weight"] = self.unpack(parts).dequantize()
        return super().dense(i, tensors)

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        from geminicompress.formats import awq, gptq, pack_quantized

        not_quantized = float_linears(self.ckpt.model, set(self.targets))
        specs = {n: self.spec for n in self.targets}
        if self.fmt == "gptq":
            return gptq.quantization_config(self.spec, specs, self.meta, self.ckpt.arch.layers + ".", not_quantized)
        if self.fmt == "awq":
            return awq.quantization_config(self.spec, self.meta, not_quantized)
        return pack_quantized.quantization_config(self.spec, specs, self.meta, not_quantized)

    def write_config(self, out: Path, result: dict[str, Any]) -> None:
        from geminicompress.formats.gptq import write_quantize_config

        config = self.qconfig(result)
        write_config(self.ckpt.model, out, config, self.dtype)
        if self.fmt == "gptq":
            write_quantize_config(out, config)


class SparseOutput(DenseOutput):
    """compressed-tensors sparse-bitmask (2:4: sparse-24-bitmask) of the pruned weights, from the keep-masks
    the stage kept for the layer (`masks(i, kept)`: {param name: keep}); the stage's achieved sparsity
    goes into the config."""

    def __init__(self, ckpt: LazyCheckpoint, dtype: torch.dtype, structure: str, targets: list[str],
                 masks: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
        from geminicompress.formats.sparse_bitmask import layout

        super().__init__(ckpt, dtype)
        self.format = f"compressed-tensors:{layout(structure)}"
        self.structure, self.targets, self.masks = structure, targets, masks

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from geminicompress.formats.sparse_bitmask import weight_tensors

        tensors = super().layer_tensors(i, layer, kept)
        for name, keep in self.masks(i, kept).items():
            tensors.update(weight_tensors(name, tensors.pop(name), keep, self.structure == "2:4"))
        return tensors

    def dense(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from geminicompress.formats.sparse_bitmask import dense_state_dict

        return super().dense(i, dense_state_dict(tensors))

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        from geminicompress.formats.sparse_bitmask import quantization_config

        ignore = [n for n in float_linears(self.ckpt.model) if f"{n}.weight" not in set(self.targets)]
        return quantization_config(self.structure, result["achieved_sparsity"], ignore)
