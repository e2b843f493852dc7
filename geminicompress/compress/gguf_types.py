"""What a quantize stage does with `--format gguf --gguf-type MIX`: each linear gets the GGUF type llama-quantize's
mix gives it (formats/gguf_mix.py), as a spec the solvers understand, and leaves its blocks' bytes kept.

Legacy 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are grids of core/grid.py (group 32); the K and IQ4 types are
two-level grids (core/kgrid.py), a spec with `grid` set, group = their sub-block. A linear llama.cpp would keep in
F16 (no block divides its rows) is not quantized. Whatever the solver, the weight written back is llama.cpp's
dequantization of the kept blocks, so the run goes on with exactly the weights the file holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from geminicompress.core.gguf_config import AUTO
from geminicompress.core.grid import QuantizedWeight, QuantSpec
from geminicompress.core.kgrid import KCodes, KTYPES
from geminicompress.formats import gguf as legacy
from geminicompress.formats.gguf_blocks import SUFFIX, dequantize, qtype
from geminicompress.formats.gguf_export import mix_types
from geminicompress.formats.gguf_kpack import pack

LEGACY: dict[str, QuantSpec] = {"Q4_0": QuantSpec(4, 32, True), "Q4_1": QuantSpec(4, 32, False),
                                "Q5_0": QuantSpec(5, 32, True), "Q5_1": QuantSpec(5, 32, False),
                                "Q8_0": QuantSpec(8, 32, True)}


def spec_for(type_name: str) -> QuantSpec:
    """The spec whose codes a tensor of GGUF type `type_name` holds."""
    if type_name in LEGACY:
        return LEGACY[type_name]
    t = KTYPES[type_name]
    return QuantSpec(t.bits, t.sub, not t.has_min, grid=type_name)


def plan(cfg: Any, model: Any, shapes: dict[str, tuple[int, int]], calibrated: bool) -> dict[str, str] | None:
    """{module: type} of the stage's targets under its --gguf-type (None without one); F16 ones left out."""
    if getattr(cfg, "format", None) != "gguf" or getattr(cfg, "gguf_type", None) in (None, AUTO):
        return None
    types = mix_types(model.config.to_dict(), shapes, cfg.gguf_type, imatrix=calibrated)
    return {name: t for name, t in types.items() if t != "F16"}


def blocks_of(codes: QuantizedWeight | KCodes, type_name: str) -> np.ndarray:
    """(rows, bytes) the blocks of a solver's codes as `type_name`."""
    if isinstance(codes, KCodes):
        return pack(codes)
    return legacy.encode_as(codes, qtype(type_name)).data


def keep_blocks(data: np.ndarray, type_name: str, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(llama.cpp's float32 weights of the blocks (rows, cols), the kept tensor {"<name>.gguf": blocks})."""
    return dequantize(data, type_name), {f"{name}.{SUFFIX}": torch.from_numpy(np.ascontiguousarray(data))}
