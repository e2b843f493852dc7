"""`--format gguf --gguf-type MIX`: every quantized tensor as the GGUF blocks of the type llama-quantize's mix gives
it (formats/gguf_mix.py), kept as bytes from the solve to the file.

The stage (GPTQ, RTN) quantizes each linear straight to its type's blocks and writes back the weights llama.cpp
computes from them (`dequantize`, bit for bit), so OUT's checkpoint is dense and holds the GGUF's weights; the
blocks themselves go to OUT/gguf_blocks.safetensors (a side file, not a weight file), which the export
(gguf_export.py) writes into model.gguf as they are. Types by name ("Q4_K", "Q5_0", ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants
from safetensors import safe_open
from safetensors.torch import save_file

from geminicompress.core.kgrid import KTYPES
from geminicompress.core.kquant import quantize as kquantize
from geminicompress.core.errors import GeminiError
from geminicompress.formats.checkpoint import GGUF_BLOCKS_FILE
from geminicompress.formats.gguf_kpack import pack
from geminicompress.formats.writer import LayerWriter

FILE = GGUF_BLOCKS_FILE
SUFFIX = "gguf"  # the kept tensor of a module: "<module>.gguf", its blocks (rows, bytes per row) uint8


def qtype(name: str) -> Q:
    return getattr(Q, name)


def block_size(name: str) -> int:
    """Weights per block of GGUF type `name` (32 or 256)."""
    return GGML_QUANT_SIZES[qtype(name)][0]


def bits_per_weight(name: str) -> float:
    """Stored bits per weight of GGUF type `name`: its block's bytes x 8 / its weights (Q4_K 4.5, Q8_0 8.5)."""
    weights, nbytes = GGML_QUANT_SIZES[qtype(name)]
    return 8.0 * nbytes / weights


def rtn_bytes(w: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """(rows, bytes) the blocks of w (rows, cols) float as `type_name`, rounded as llama-quantize does: the K and
    IQ4 types by its weighted searches (core/kquant.py, `importance` its imatrix row), the legacy types by its
    reference rounding (gguf.quants, no importance)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if type_name in KTYPES:
        return pack(kquantize(w, type_name, importance))
    return quants.quantize(w, qtype(type_name))


def dequantize(data: np.ndarray, type_name: str) -> torch.Tensor:
    """(rows, cols) float32: llama.cpp's weights of the blocks (gguf.quants, its reference dequantization)."""
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype(type_name))))


class BlocksWriter(LayerWriter):
    """A dense checkpoint (the stage wrote the blocks' weights back) whose quantized linears' blocks, kept as
    "<linear>.gguf", are gathered for OUT/gguf_blocks.safetensors; `types`: {full module name: type name}."""

    gguf = True  # finish_export writes model.gguf

    def __init__(self, model: nn.Module, dtype: torch.dtype, types: dict[str, str]) -> None:
        super().__init__(model, dtype)
        self.types = types
        self.blocks: dict[str, torch.Tensor] = {}

    def layer_tensors(self, i: int, layer: nn.Module, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = self.prefix(i)
        for key, data in kept.items():
            if key.endswith("." + SUFFIX):
                self.blocks[f"{head}.{key.removesuffix('.' + SUFFIX)}"] = data.contiguous()
        return super().layer_tensors(i, layer, kept)

    def write_config(self, out: Path, result: dict[str, Any]) -> dict[str, Any]:
        missing = sorted(set(self.types) - set(self.blocks))
        if missing:
            raise GeminiError(f"--gguf-type: no blocks kept for {missing[0]} (a resumed run keeps the blocks of the "
                              "layers it ran only: run it again without resuming)")
        meta = {name: json.dumps([self.types[name], int(self.model.get_submodule(name).in_features)])
                for name in self.blocks}
        save_file(self.blocks, str(out / FILE), metadata=meta)
        info = super().write_config(out, result)
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return {**info, "gguf_types": counts}


def read_blocks(out: Path) -> dict[str, tuple[str, int, np.ndarray]]:
    """{module: (type name, columns, blocks (rows, bytes) uint8)} of OUT's side file ({} when there is none)."""
    path = out / FILE
    if not path.is_file():
        return {}
    found = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            type_name, cols = json.loads(meta[name])
            found[name] = (type_name, int(cols), f.get_tensor(name).numpy())
    return found
