"""Peak memory and disk of a streamed run, estimated from the tensor shapes before any work."""

from __future__ import annotations

from typing import Any

import torch

from geminicompress.compress.arch import get_module
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.streaming.gptq import gptq_dtypes

BASE_BYTES = 800 << 20  # the interpreter, torch, transformers, the skeleton and tokenizer (measured: ~0.7 GiB)


def estimate(ckpt: LazyCheckpoint, out_dtype: torch.dtype, int8: bool, max_shard: int,
             windows: tuple[int, int] | None = None, gptq: Any = None) -> dict[str, int]:
    """Peak memory and disk of a streamed run, from the tensor shapes alone. Uncalibrated: one layer as
    stored plus a few float32 temporaries of its biggest tensor; calibrated (windows = (n, T), `gptq` the
    stage's options): the layer's weights (and a copy in the calibration dtype where that differs), the
    activations the one pass holds at the MLP's down projection (every window's layer input, residual,
    normed input and (n·T, intermediate) product), two buffers of the widest Hessian (the solver's) and
    three float32 copies of the biggest linear (the solver's weight, its codes, the dequantized result)."""
    n_layers = len(ckpt.layers)
    prefix = ckpt.layer_prefix(0) + "."
    biggest = max(i.numel for n, i in ckpt.tensors.items() if n.startswith(prefix))  # a decoder linear
    if windows is None:
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i)) for i in range(n_layers)) + 3 * 4 * biggest
        outside = max((2 * ckpt.nbytes(m) for m in ckpt.outside_modules()), default=0)  # read + written copy
        peak = BASE_BYTES + max(layer, outside)
    else:
        calib, held = gptq_dtypes(gptq, ckpt, out_dtype)
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i), held) for i in range(n_layers))
        if calib != held:
            layer += max(ckpt.nbytes(ckpt.layer_prefix(i), calib) for i in range(n_layers))
        widest = max(get_module(ckpt.model, n).in_features for n in
                     (f"{ckpt.layer_prefix(0)}.{lin}" for lin in ckpt.arch.linears))
        hidden = ckpt.model.config.hidden_size
        per_token = widest + 3 * hidden if gptq.one_pass else 3 * hidden  # --multi-pass: in and out, and a batch's
        activations = windows[0] * windows[1] * per_token * calib.itemsize
        peak = BASE_BYTES + layer + activations + 2 * 4 * widest**2 + 3 * 4 * biggest
    disk = 0
    for name, info in ckpt.tensors.items():
        if info.dtype.is_floating_point:
            disk += info.numel * (1 if int8 and name.endswith("proj.weight") else out_dtype.itemsize)
        else:
            disk += info.nbytes
    return {"peak_memory_bytes": peak, "disk_bytes": disk + min(max_shard, disk)}
