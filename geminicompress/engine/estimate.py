"""Peak memory and disk of a streamed run, estimated from the tensor shapes before any work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from geminicompress.core.arch import get_module
from geminicompress.core.rows import BLOCK_BYTES
from geminicompress.host.diskerrors import free_bytes, size_text, tree_bytes
from geminicompress.engine.contract import walk_dtypes
from geminicompress.engine.verify import TOKENS as PROBE_TOKENS
from geminicompress.engine.verify import WINDOWS as PROBE_WINDOWS
from geminicompress.core.errors import InputError
from geminicompress.kernels.int8 import PACK_BYTES
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.host.output import final_name

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


@dataclass(frozen=True)
class Sizes:
    """What the estimate needs of a checkpoint, read once from its headers and skeleton: the bytes of each decoder
    layer and of each module outside them (a tied head left out), as stored (key None) and in each dtype asked
    for; the output head's (`head`: its name, None where the model has none) and the input embedding table's
    bytes as stored; the elements of layer 0's biggest tensor, its widest linear's inputs and the hidden size; and
    every stored tensor's (name, numel, dtype), for the disk."""

    layers: list[dict[torch.dtype | None, int]]
    outside: dict[str, dict[torch.dtype | None, int]]
    head: str | None
    head_bytes: dict[torch.dtype | None, int]
    head_rows: int
    embed: int
    biggest: int
    widest: int
    hidden: int
    tensors: list[tuple[str, int, torch.dtype]]


def read_sizes(ckpt: LazyCheckpoint, dtypes: Iterable[torch.dtype], calibrated: bool = True) -> Sizes:
    """The checkpoint's `Sizes`, each module's bytes as stored and in `dtypes` (the head's also in int8, float16
    and float32: what the check holds of it). Uncalibrated: no embedding table or widest linear read (0)."""
    keys = [None, torch.float32, *dict.fromkeys(dtypes)]
    model = ckpt.model
    first = ckpt.layer_prefix(0)
    layers = [{d: ckpt.nbytes(ckpt.layer_prefix(i), d) for d in keys} for i in range(len(ckpt.layers))]
    outside = {m: {d: ckpt.nbytes(m, d) for d in (*keys, torch.int8)}
               for m in ckpt.outside_modules() if m != ckpt.tied_output}
    names = {m: n for n, m in model.named_modules()}  # each module's name (named_modules gives a module once)
    head = model.get_output_embeddings()
    head_name = names[head] if head is not None else None
    head_bytes = {}
    if head_name is not None:
        head_bytes = {d: ckpt.nbytes(head_name, d) for d in (None, torch.int8, torch.float16, torch.float32)}
    embed = widest = 0
    if calibrated:
        embed = ckpt.nbytes(names[model.get_input_embeddings()])
        widest = max(get_module(model, f"{first}.{lin}").in_features for lin in ckpt.arch.linears)
    return Sizes(layers, outside, head_name, head_bytes, head.weight.shape[0] if head is not None else 0, embed,
                 max(i.numel for n, i in ckpt.tensors.items() if n.startswith(first + ".")), widest,
                 model.config.hidden_size, [(n, i.numel, i.dtype) for n, i in ckpt.tensors.items()])


def estimate(ckpt: LazyCheckpoint, out_dtype: torch.dtype, quantized: bool, max_shard: int,
             calib: Calibration | None = None, changed: frozenset[str] = frozenset()) -> dict[str, int]:
    """Peak memory and disk of a streamed run, from the tensor shapes alone (`peak`)."""
    dtypes = [out_dtype, *((calib.calib_dtype, calib.layer_dtype) if calib is not None else ())]
    return peak(read_sizes(ckpt, dtypes, calib is not None), out_dtype, quantized, max_shard, calib, changed)


def peak(sizes: Sizes, out_dtype: torch.dtype, quantized: bool, max_shard: int, calib: Calibration | None = None,
         changed: frozenset[str] = frozenset()) -> dict[str, int]:
    """The peak is the base plus the largest of the run's phases: layer 0's inputs captured (calibrated), a layer
    worked on (`layer_phase`), each module outside the layers written (`outside_phase`; `changed`: those a stage
    replaces, an INT8 head), and the check of OUT (`check_phase`); the disk is OUT as written (`out_bytes`)."""
    phases = [layer_phase(sizes, calib), outside_phase(sizes, out_dtype, changed), check_phase(sizes, changed)]
    if calib is not None:
        n, T = calib.windows  # the table read as stored, the rows looked up in float32, the store of the inputs
        phases.append(sizes.embed + n * T * sizes.hidden * (4 + calib.calib_dtype.itemsize))
    disk = out_bytes(sizes.tensors, out_dtype, quantized, max_shard)
    return {"peak_memory_bytes": BASE_BYTES + max(phases), "disk_bytes": disk}


def layer_phase(sizes: Sizes, calib: Calibration | None) -> int:
    """A layer worked on. Uncalibrated: the layer as stored plus a few float32 temporaries of its biggest
    tensor; calibrated: the layer's weights (and a copy in the calibration dtype where that differs), the
    activations held (one pass: every window's layer input, residual, normed input and (n·T, intermediate)
    product at the MLP's down projection; else the layer's inputs and outputs and a batch's), the stages'
    square buffers and three float32 copies of the biggest linear (a solver's weight, its codes, the
    dequantized result)."""
    temporaries = 3 * 4 * sizes.biggest
    if calib is None:
        return max(layer[None] for layer in sizes.layers) + temporaries
    held = max(layer[calib.layer_dtype] for layer in sizes.layers)
    if calib.calib_dtype != calib.layer_dtype:
        held += max(layer[calib.calib_dtype] for layer in sizes.layers)
    per_token = sizes.widest + 3 * sizes.hidden if calib.one_pass else 3 * sizes.hidden  # else: in, out, a batch's
    n, T = calib.windows
    activations = n * T * per_token * calib.calib_dtype.itemsize
    return held + activations + calib.squares * 4 * sizes.widest**2 + temporaries


def outside_phase(sizes: Sizes, out_dtype: torch.dtype, changed: frozenset[str]) -> int:
    """The biggest module outside the layers as it is written: read as stored, plus its written copy where the
    output dtype differs; one a stage replaces (an INT8 head) adds its codes, a byte a weight, and the blocks
    of rows they are made from, and the codes as written (shifted, packed: a byte a weight each). A tied head
    is not written."""
    out = 0
    for m, nbytes in sizes.outside.items():
        stored, written = nbytes[None], nbytes[out_dtype]
        out = max(out, stored + (written if written != stored else 0)
                  + (3 * nbytes[torch.int8] + 2 * BLOCK_BYTES if m in changed else 0))
    return out


def check_phase(sizes: Sizes, changed: frozenset[str]) -> int:
    """The check of OUT (engine/verify.py): OUT read back one layer at a time in float32; then the head as
    stored, with a block of its rows in float32 (outside_float32.py) or, where a stage replaced it (an INT8
    head), its codes (a byte a weight), the kernel's float16 packs and the float32 rows it packs a block from
    (kernels/int8.py), and three (windows, tokens, vocab) float32 logits (the run's, OUT's, their difference).
    OUT's INT8 head, read back, is its codes and a block of dequantized rows (formats/dequant.py): less."""
    layer = max(layer[torch.float32] for layer in sizes.layers)
    if sizes.head is None:
        return layer
    head = sizes.head_bytes
    packed = (head[torch.int8] + head[torch.float16] + min(head[torch.float32], PACK_BYTES)
              if sizes.head in changed else 0)
    logits = 3 * PROBE_WINDOWS * PROBE_TOKENS * sizes.head_rows * 4
    return max(layer, head[None] + max(packed, BLOCK_BYTES) + logits)


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


def check_disk_in_memory(ctx: Any, quantized: bool, max_shard: int) -> int:
    """Before the stages of a run in memory: OUT's estimated size (from the model's tensors; `quantized`: a
    stage quantizes them) against the free disk (check_disk). Returns the estimate."""
    if ctx.model is None:  # a distill stage with a streamed teacher builds its student itself: no estimate
        return 0
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
    quantized = any(s.quantizes for s in stages)
    changed = frozenset().union(*(s.outside_names() for s in stages))
    need = estimate(ckpt, ctx.out_dtype, quantized, max_shard, calib, changed)
    ctx.progress.info(f"streaming {len(ckpt.layers)} layers from {ckpt.path}: estimated peak memory "
                      f"{need['peak_memory_bytes'] / 2**30:.2f} GiB, disk {need['disk_bytes'] / 2**30:.2f} GiB")
    check_disk(ctx.out_dir, need["disk_bytes"])
    return need
