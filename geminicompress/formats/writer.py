"""A format, one decoder layer at a time: the one writer of every format (each format module's `writer(...)`
builds one of these). A checkpoint is written by the engine's sink as a loop over the layers (then the
modules outside them and config.json), whether the model is in memory or read from disk layer by layer.

`LayerWriter` is the dense checkpoint (also a b-bit method's fake-quantized weights with `--format dense`),
`PackedWriter` a b-bit format. Each also says how a resumed run puts a finished layer's written tensors back
(`load_back`), and which weights the format stores as exact integer codes (`exact_weights`: verify.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for
from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.formats.checkpoint import float_linears, module_tensors, write_config

QWeights = Callable[[int, dict[str, torch.Tensor]], Mapping[str, QuantizedWeight]]  # (layer, kept) -> {module: qw}


class LayerWriter:
    """Every tensor of the layer in the output dtype; config.json with `qconfig` (None: a dense checkpoint)."""

    format = "dense"

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.layers_path = arch_for(model).layers

    def prefix(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return module_tensors(self.prefix(i), layer, self.dtype)

    def outside_tensors(self, name: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """What OUT stores of module `name` outside the decoder layers (an output head)."""
        return module_tensors(name, module, self.dtype)

    def dense(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A finished layer's written tensors as the dense state dict of the layer (names relative to it)."""
        head = self.prefix(i) + "."
        return {k[len(head):]: v for k, v in tensors.items()}

    @torch.no_grad()
    def load_back(self, i: int, layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put a finished layer's written tensors back into it (to compute the next layer's inputs on resume)."""
        state = layer.state_dict(keep_vars=True)
        for name, value in self.dense(i, tensors).items():
            state[name].data.copy_(value.to(state[name].dtype))

    def exact_weights(self, i: int, kept: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
        """{linear relative to layer i: a function making its weight} for the weights stored as exact codes."""
        return {}

    def as_written_exact(self, i: int, layer: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
        """Like `exact_weights`, for layer i rebuilt from its written tensors (`load_back`): its weights stored as
        codes, which hold their dequantized values exactly in float32 (none for a dense checkpoint)."""
        return {}

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        """config.json (+ the format's files beside it); `result`: the writing stage's result for report.json.
        Returns what report.json's `export` says of the format."""
        write_config(self.model, out, self.qconfig(result), self.dtype)
        return {"format": self.format}


@dataclass(frozen=True)
class PackedLayout:
    """A b-bit format's layout: its key (config.json's quant_method), `pack(qw)` -> the tensors stored for one
    quantized linear (with these `suffixes`), `unpack(parts, spec)` back, `qconfig(base, specs, not_quantized)`
    -> its quantization_config, and `extra(out, config)` writing its side files (None: none)."""

    key: str
    pack: Callable[[QuantizedWeight], dict[str, torch.Tensor]]
    unpack: Callable[[dict[str, torch.Tensor], QuantSpec], QuantizedWeight]
    suffixes: tuple[str, ...]
    qconfig: Callable[[QuantSpec, dict[str, QuantSpec], list[str]], dict[str, Any]]
    extra: Callable[[Path, dict[str, Any]], None] | None = None


class PackedWriter(LayerWriter):
    """A b-bit format: each quantized linear's weight replaced by `pack(qw)` of the codes the stage kept
    (`qweights(i, kept)`: {full module name: QuantizedWeight} of layer i), read back by `unpack(parts, spec)`
    (the format's `PackedLayout`). `specs`: every quantized module's spec (mixed precision: several)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, specs: dict[str, QuantSpec], qweights: QWeights,
                 layout: PackedLayout) -> None:
        super().__init__(model, dtype)
        self.format, self.specs, self.qweights = layout.key, specs, qweights
        self.pack, self.unpack, self.suffixes = layout.pack, layout.unpack, layout.suffixes
        self._qconfig, self.extra = layout.qconfig, layout.extra

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        qweights = self.qweights(i, kept)
        prefix = self.prefix(i)
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
        prefix = self.prefix(i) + "."
        for name in [n for n in self.specs if n.startswith(prefix)]:
            parts = {k: tensors.pop(f"{name}.{k}") for k in self.suffixes if f"{name}.{k}" in tensors}
            tensors[f"{name}.weight"] = self.unpack(parts, self.specs[name]).dequantize()
        return super().dense(i, tensors)

    def exact_weights(self, i: int, kept: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
        qweights = self.qweights(i, kept)  # a lazy mapping: unpacked when read
        head = self.prefix(i) + "."
        return {name.removeprefix(head): (lambda name=name: qweights[name].dequantize()) for name in qweights}

    def as_written_exact(self, i: int, layer: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
        head = self.prefix(i) + "."
        weights = {n.removeprefix(head): layer.get_submodule(n.removeprefix(head)).weight.detach().clone()
                   for n in self.specs if n.startswith(head)}
        return {name: (lambda w=w: w) for name, w in weights.items()}

    def base_spec(self) -> QuantSpec:
        """The spec holding the most weights, in layer order (ties: the first met): the format's top level."""
        weights: Counter = Counter()
        for name in sorted(self.specs, key=self._layer_order):
            module = self.model.get_submodule(name)
            weights[self.specs[name]] += module.in_features * module.out_features
        return weights.most_common(1)[0][0]

    def _layer_order(self, name: str) -> tuple[int, str]:
        """Sort key of a module name under the decoder layers: (layer index, the rest)."""
        index, _, rest = name.removeprefix(self.layers_path + ".").partition(".")
        return int(index), rest

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        return self._qconfig(self.base_spec(), self.specs, float_linears(self.model, set(self.specs)))

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        config = self.qconfig(result)
        write_config(self.model, out, config, self.dtype)
        if self.extra is not None:
            self.extra(out, config)
        base = self.base_spec()
        return {"format": self.format, "bits": base.bits, "group_size": base.group_size, "sym": base.sym,
                "quantized_modules": len(self.specs), "float_modules": float_linears(self.model, set(self.specs))}
