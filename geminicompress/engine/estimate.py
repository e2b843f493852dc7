"""Peak memory and disk of a streamed run, estimated from the tensor shapes before any work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from geminicompress.core.arch import get_module
from geminicompress.diskerrors import free_bytes, size_text, tree_bytes
from geminicompress.engine.contract import walk_dtypes
from geminicompress.errors import InputError
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.output import final_name

BASE_BYTES = 800 << 20  # the interpreter, torch, transformers, the skeleton and tokenizer (measured: ~0.7 GiB)


@dataclass(frozen=True)
class Calibration:
    """How a calibrated run holds a layer: the windows (n, T), the dtype the layer computes in and the
    dtype of its weights, whether a stage runs the windows in one pass (`onepass.py`: every window's
    activations up to the MLP product alive at once), and how many float32 (widest input)² buffers the
    stages hold at their peak (Hessians, solver scratch: GPTQ 1, SparseGPT 2, AWQ 2, Wanda and
    SmoothQuant none)."""

    windows: tuple[int, int]
    calib_dtype: torch.dtype
    layer_dtype: torch.dtype
    one_pass: bool
    squares: int


def estimate(ckpt: LazyCheckpoint, out_dtype: torch.dtype, quantized: bool, max_shard: int,
             calib: Calibration | None = None) -> dict[str, int]:
    """Peak memory and disk of a streamed run, from the tensor shapes alone. Uncalibrated: one layer as
    stored plus a few float32 temporaries of its biggest tensor; calibrated: the layer's weights (and a
    copy in the calibration dtype where that differs), the activations held (one pass: every window's
    layer input, residual, normed input and (n·T, intermediate) product at the MLP's down projection;
    else the layer's inputs and outputs and a batch's), the stages' square buffers and three float32
    copies of the biggest linear (a solver's weight, its codes, the dequantized result)."""
    n_layers = len(ckpt.layers)
    prefix = ckpt.layer_prefix(0) + "."
    biggest = max(i.numel for n, i in ckpt.tensors.items() if n.startswith(prefix))  # a decoder linear
    if calib is None:
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i)) for i in range(n_layers)) + 3 * 4 * biggest
        outside = max((2 * ckpt.nbytes(m) for m in ckpt.outside_modules()), default=0)  # read + written copy
        peak = BASE_BYTES + max(layer, outside)
    else:
        layer = max(ckpt.nbytes(ckpt.layer_prefix(i), calib.layer_dtype) for i in range(n_layers))
        if calib.calib_dtype != calib.layer_dtype:
            layer += max(ckpt.nbytes(ckpt.layer_prefix(i), calib.calib_dtype) for i in range(n_layers))
        widest = max(get_module(ckpt.model, n).in_features for n in
                     (f"{ckpt.layer_prefix(0)}.{lin}" for lin in ckpt.arch.linears))
        hidden = ckpt.model.config.hidden_size
        per_token = widest + 3 * hidden if calib.one_pass else 3 * hidden  # else: in and out, and a batch's
        n, T = calib.windows
        activations = n * T * per_token * calib.calib_dtype.itemsize
        peak = BASE_BYTES + layer + activations + calib.squares * 4 * widest**2 + 3 * 4 * biggest
    disk = out_bytes(((n, i.numel, i.dtype) for n, i in ckpt.tensors.items()), out_dtype, quantized, max_shard)
    return {"peak_memory_bytes": peak, "disk_bytes": disk}


def out_bytes(tensors: Iterable[tuple[str, int, torch.dtype]], out_dtype: torch.dtype, quantized: bool,
              max_shard: int) -> int:
    """OUT's size on disk while it is written, from its input's (name, numel, dtype): every tensor as written
    (floats in the output dtype; a quantized linear's weight about a byte per weight), plus one shard's worth
    (a shard that does not fit its reserved header is copied once)."""
    disk = sum(numel * (1 if quantized and name.endswith("proj.weight") else out_dtype.itemsize)
               if dtype.is_floating_point else numel * dtype.itemsize for name, numel, dtype in tensors)
    return disk + min(max_shard, disk)


def check_disk(out_dir: Path, need: int) -> None:
    """An InputError (before any work) when the disk that OUT's partial folder `out_dir` is on has less free
    than `need` bytes; the partial folder is then removed (output.py: an input error keeps nothing)."""
    free = free_bytes(Path(out_dir))
    if free is not None and free + tree_bytes(Path(out_dir)) < need:  # an earlier attempt's files are rewritten
        raise InputError(f"not enough disk for {final_name(Path(out_dir))}: it needs about {size_text(need)} and "
                         f"{Path(out_dir).resolve().parent} has {size_text(free)} free; free some space or choose "
                         "another output folder; nothing was written")


def check_disk_in_memory(ctx: Any, stages: list[Any], max_shard: int) -> int:
    """Before the stages of a run in memory: OUT's estimated size (from the model's tensors) against the free
    disk (check_disk). Returns the estimate."""
    if ctx.model is None:  # a distill stage with a streamed teacher builds its student itself: no estimate
        return 0
    quantized = any(s.type == "quantize" for s in stages)
    state = ctx.model.state_dict()
    need = out_bytes(((n, t.numel(), t.dtype) for n, t in state.items()), ctx.out_dtype, quantized, max_shard)
    check_disk(ctx.out_dir, need)
    return need


def announce(ctx: Any, stages: list[Any], max_shard: int) -> dict[str, int]:
    """Before any layer of a streamed run is read: its estimated peak memory and disk, said in one line;
    an InputError when the disk OUT goes to has less free than that."""
    ckpt = ctx.layers.ckpt
    dtypes = walk_dtypes(stages)
    calib = None
    if dtypes is not None:
        cal = ctx.recipe.calibration
        calib = Calibration((cal.samples, cal.seq_len), dtypes[0], dtypes[1],
                            any(s.one_pass_memory for s in stages),
                            sum(s.squares for s in stages))
    quantized = any(s.cfg.type == "quantize" for s in stages)
    need = estimate(ckpt, ctx.out_dtype, quantized, max_shard, calib)
    ctx.progress.info(f"streaming {len(ckpt.layers)} layers from {ckpt.path}: estimated peak memory "
                      f"{need['peak_memory_bytes'] / 2**30:.2f} GiB, disk {need['disk_bytes'] / 2**30:.2f} GiB")
    check_disk(ctx.out_dir, need["disk_bytes"])
    return need
