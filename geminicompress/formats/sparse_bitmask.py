"""The compressed-tensors sparse-bitmask layouts, so that a pruned checkpoint shrinks with its sparsity.

For a weight `<module>.weight` (out, in) with keep-mask K, the file holds instead (compressed-tensors'
BitmaskCompressor / Sparse24BitMaskCompressor layout, keys without the `.weight` suffix):
- `<module>.compressed`: the kept values in row-major order; 1-D for `sparse-bitmask`,
  (out, in/2) for `sparse-24-bitmask` (exactly 2 kept of every 4);
- `<module>.bitmask`: K packed 8 columns per uint8 along each row, little bit order: (out, ceil(in/8));
- `<module>.shape`: the dense shape, int64 (2, 1);
- `<module>.row_offsets` (`sparse-bitmask` only): index into `compressed` of each row's first value, (out,).
config.json -> quantization_config = {quant_method: compressed-tensors, sparsity_config: {format, ...}}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import Tensor

from geminicompress.formats.checkpoint import compressed_tensors_format, float_linears
from geminicompress.formats.reader import ModuleReader
from geminicompress.formats.writer import LayerWriter

KEY = "compressed-tensors:sparse-bitmask"  # and its 2:4 variant, sparse-24-bitmask
FORMATS = ("sparse-bitmask", "sparse-24-bitmask")
SUFFIXES = ("compressed", "bitmask", "shape", "row_offsets")
_BITS = 1 << torch.arange(8, dtype=torch.int32)  # little bit order: column 8j+b -> bit b of byte j


def detect(qc: dict[str, Any]) -> bool:
    return compressed_tensors_format(qc) in FORMATS


def pack_bits(keep: Tensor) -> Tensor:
    """(rows, cols) bool -> (rows, ceil(cols/8)) uint8."""
    rows, cols = keep.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int32)
    padded[:, :cols] = keep.to(torch.int32)
    return (padded.view(rows, -1, 8) * _BITS).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, cols: int) -> Tensor:
    """(rows, ceil(cols/8)) uint8 -> (rows, cols) bool."""
    bits = (packed.to(torch.int32).unsqueeze(-1) & _BITS) != 0  # (rows, bytes, 8)
    return bits.flatten(1)[:, :cols]


def compress(weight: Tensor, keep: Tensor, two_four: bool) -> dict[str, Tensor]:
    """The layout's tensors for one weight (suffix -> tensor). `keep`: (out, in) bool, True = stored."""
    rows, cols = weight.shape
    values = weight[keep]  # (nnz,), row-major
    out = {"compressed": values.reshape(rows, cols // 2) if two_four else values,
           "bitmask": pack_bits(keep), "shape": torch.tensor([rows, cols], dtype=torch.int64).reshape(-1, 1)}
    if not two_four:
        counts = keep.sum(1)
        out["row_offsets"] = counts.cumsum(0) - counts
    return out


def decompress(parts: dict[str, Tensor]) -> Tensor:
    """Dense weight from one module's layout tensors (either layout)."""
    rows, cols = (int(v) for v in parts["shape"].flatten())
    keep = unpack_bits(parts["bitmask"], cols)
    values = parts["compressed"].flatten()
    dense = torch.zeros(rows, cols, dtype=values.dtype)
    dense[keep] = values
    return dense


def layout(structure: str) -> str:
    """The format name of a sparsity structure ("2:4" or anything else)."""
    return FORMATS[1] if structure == "2:4" else FORMATS[0]


def weight_tensors(name: str, tensor: Tensor, keep: Tensor, two_four: bool) -> dict[str, Tensor]:
    """The layout's tensors of weight `name` ("<module>.weight", in the output dtype): unstructured, the
    kept values that are not zero in that dtype; 2:4, exactly the kept ones."""
    keep = keep.cpu() & (tensor != 0) if not two_four else keep.cpu()
    return {f"{name.removesuffix('.weight')}.{k}": v for k, v in compress(tensor, keep, two_four).items()}


def quantization_config(structure: str, global_sparsity: float, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for a pruned model (`ignore`: the linears stored dense)."""
    fmt = layout(structure)
    sparsity = {"format": fmt, "global_sparsity": round(global_sparsity, 6), "sparsity_structure": structure,
                "targets": ["Linear"], "ignore": ignore}
    return {"quant_method": "compressed-tensors", "format": fmt, "sparsity_config": sparsity}


class SparseWriter(LayerWriter):
    """compressed-tensors sparse-bitmask (2:4: sparse-24-bitmask) of the pruned weights, one layer at a time,
    from the keep-masks the stage kept for the layer (`masks(i, kept)`: {param name: keep}); the stage's
    achieved sparsity goes into the config; `targets`: the pruned weights (param names)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, structure: str, targets: list[str],
                 masks: Callable[[int, dict[str, Tensor]], dict[str, Tensor]]) -> None:
        super().__init__(model, dtype)
        self.format = f"compressed-tensors:{layout(structure)}"
        self.structure, self.targets, self.masks = structure, set(targets), masks

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, Tensor]) -> dict[str, Tensor]:
        tensors = super().layer_tensors(i, layer, kept)
        for name, keep in self.masks(i, kept).items():
            tensors.update(weight_tensors(name, tensors.pop(name), keep, self.structure == "2:4"))
        return tensors

    def dense(self, i: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every `<module>.{compressed,bitmask,shape[,row_offsets]}` group replaced by `<module>.weight`."""
        dense = dict(tensors)
        for module in [k.removesuffix(".bitmask") for k in tensors if k.endswith(".bitmask")]:
            parts = {s: dense.pop(f"{module}.{s}") for s in SUFFIXES if f"{module}.{s}" in dense}
            dense[f"{module}.weight"] = decompress(parts)
        return super().dense(i, dense)

    def qconfig(self, result: dict[str, Any]) -> dict[str, Any]:
        ignore = [n for n in float_linears(self.model) if f"{n}.weight" not in self.targets]
        return quantization_config(self.structure, result["achieved_sparsity"], ignore)

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        return {**super().write_config(out, result), "sparsity_structure": self.structure}


def reader(path: Path, config: dict[str, Any]) -> ModuleReader:
    """How a sparse-bitmask linear is read: an ordinary `nn.Linear` with its dense weight decompressed."""

    def build(name: str, parts: dict[str, Tensor], dtype: torch.dtype) -> nn.Module:
        weight = decompress(parts).to(dtype)  # (out, in)
        bias = parts.get("bias")
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return linear

    return ModuleReader("bitmask", (*SUFFIXES, "bias"), build)
