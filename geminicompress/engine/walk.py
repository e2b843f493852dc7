"""The walk: every decoder layer in order, each fed the modified previous one (the one engine's loop).

The GPTQ paper's memory-bounded scheme, for every method and every run, in memory or streamed:
1. run the calibration windows through the model up to decoder layer 0 and keep its inputs;
2. for each layer: take it from the *source* (a model in memory: `ModelLayers`; a checkpoint read one
   layer at a time: `models.lazy.LazyLayers`), move it to the compute device, let the method's per-layer
   function (`LayerFn`, layers.py) collect what it needs from the layer's inputs and modify the layer,
   run the *modified* layer over the inputs to get the next layer's inputs, and hand the finished layer
   to the *sink* (it stays in the model, resumable: `StateDirSink`; or it is written and dropped).
Only one decoder layer and one set of activations are on the device at a time.

Resumable: a sink knows which layers are finished; a restarted run restores them (the layer's weights and
the tensors the method kept) and recomputes the activations through them instead of storing activations.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from geminicompress.compress.arch import Arch, arch_for, get_module
from geminicompress.engine.layers import (LayerFn, LayerInputs, LayerJob, capture_inputs, computing_in, forward_layer,
                                          move_outside_layers)
from geminicompress.memory import heap_reuse, release_free_heap
from geminicompress.progress import NullProgress, Progress


class LayerSource(Protocol):
    """Where the decoder layers come from: `ModelLayers` (a model in memory) or `models.lazy.LazyLayers`
    (read from disk one at a time)."""

    model: nn.Module

    def __len__(self) -> int: ...

    def load(self, i: int) -> nn.Module: ...  # layer i, with its weights, on the CPU

    def release(self, i: int) -> None: ...  # done with layer i

    def capture_modules(self) -> list[str]: ...  # modules outside the layers a forward up to layer 0 needs


class LayerSink(Protocol):
    """Where finished layers go: `StateDirSink` (they stay in the model; resumable copies in state_dir)
    or `streaming.sink.ShardSink` (written into output shards, then dropped)."""

    restores_weights: bool  # whether `restore` loads a finished layer's weights back (else: summary only)

    def finished(self, i: int) -> bool: ...

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]: ...

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class ModelLayers:
    """The decoder layers of a model in memory: loading and releasing them is free."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = get_module(model, arch_for(model).layers)

    def __len__(self) -> int:
        return len(self.layers)

    def load(self, i: int) -> nn.Module:
        return self.layers[i]

    def release(self, i: int) -> None:
        return None

    def capture_modules(self) -> list[str]:
        return []


class StateDirSink:
    """Finished layers stay in the model; with a state_dir, each is also saved there for resuming."""

    restores_weights = True

    def __init__(self, state_dir: Path | None) -> None:
        self.state_dir = state_dir

    def finished(self, i: int) -> bool:
        return self.state_dir is not None and all(p.is_file() for p in _paths(self.state_dir, i))

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]:
        done = _restore(self.state_dir, i, layer)
        assert done is not None, "restore() is called for finished layers only"
        return done

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _save(self.state_dir, i, layer, summary, kept)
        return kept


def run_layerwise(model: nn.Module | LayerSource, windows: torch.Tensor | None, process: LayerFn, *,
                  device: torch.device, progress: Progress | None = None, state_dir: Path | None = None,
                  description: str = "layers", calib_dtype: torch.dtype | None = None,
                  sink: LayerSink | None = None) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Apply `process` to every decoder layer in order, feeding each layer the modified previous one.

    model: a model in memory, or a `LayerSource` (e.g. layers read from disk one at a time).
    windows: calibration windows (n, T); None for a method that needs no activations (the layers are
    then not run at all, and `LayerJob.inputs` is None).
    calib_dtype: the dtype the layers compute in during calibration (None: their own). With a lower one,
    `process` must read and write weights through `LayerJob.weight`/`set_weight`.
    sink: where finished layers go (default: they stay in the model, saved in `state_dir` for resuming).

    Returns the per-layer summaries and the tensors the sink kept of all layers, keyed
    `"<layer index>.<name>"` as the method named them (e.g. "3.self_attn.q_proj.q").
    """
    progress = progress or NullProgress()
    source = model if not isinstance(model, nn.Module) else ModelLayers(model)
    sink = sink or StateDirSink(state_dir)
    arch = arch_for(source.model)
    layers = get_module(source.model, arch.layers)
    inputs = _capture(source, windows, device, calib_dtype) if windows is not None else None
    summaries: list[dict[str, Any]] = []
    kept: dict[str, torch.Tensor] = {}
    with progress.task(description, total=len(source)) as bar, heap_reuse():
        for i in range(len(source)):
            finished = sink.finished(i)
            if finished and inputs is None and not sink.restores_weights:  # nothing to run through it
                summary, tensors = sink.restore(i, None)
                summary = {**summary, "resumed": True}
            else:
                t0 = time.perf_counter()
                layer = source.load(i).to(device)
                done = sink.restore(i, layer) if finished else None
                summary, tensors, inputs = _one_layer(i, layer, inputs, process, device, arch, calib_dtype, done, sink)
                layer.to("cpu" if device.type != "cpu" else device)
                source.release(i)
                if done is None:
                    summary = {**summary, "layer_seconds": round(time.perf_counter() - t0, 3)}
            kept.update({f"{i}.{k}": v for k, v in tensors.items()})
            summaries.append({"layer": i, **summary})
            release_free_heap()  # the layer's freed small buffers leave resident memory (memory.py)
            bar.advance(1, **{k: v for k, v in summary.items()
                              if isinstance(v, (int, float)) and k not in ("layer", "layer_seconds")})
    move_outside_layers(source.model, layers, torch.device("cpu"))
    return summaries, kept


def _capture(source: LayerSource, windows: torch.Tensor, device: torch.device,
             calib_dtype: torch.dtype | None) -> LayerInputs:
    """The inputs of decoder layer 0, with the modules the source must provide for it loaded meanwhile
    (in float32, as a model in memory holds them: the embeddings' outputs are then the same)."""
    loaded = source.capture_modules()
    materialise = getattr(source, "ckpt", None)
    for name in loaded:
        materialise.materialise(name, torch.float32)
    hidden = source.model.config.hidden_size
    storage = activation_storage(windows, hidden, calib_dtype or torch.float32, device)
    try:
        return capture_inputs(source.model, windows, device, storage, dtype=calib_dtype)
    finally:
        for name in loaded:
            materialise.release(name)


def activation_storage(windows: torch.Tensor, hidden: int, dtype: torch.dtype, device: torch.device,
                       share: float = 0.25) -> torch.device:
    """Where the calibration activations live between layers: on the GPU when a layer's inputs and outputs
    for every window (2·n·T·hidden values) take at most `share` of its free memory (no copy to and from
    the host per layer), else on the CPU (the GPU then holds one batch at a time)."""
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    need = 2 * windows.numel() * hidden * dtype.itemsize
    return device if need <= share * free else torch.device("cpu")


def _one_layer(i: int, layer: nn.Module, inputs: LayerInputs | None, process: LayerFn, device: torch.device,
               arch: Arch, calib_dtype: torch.dtype | None, done: tuple | None,
               sink: LayerSink) -> tuple[dict[str, Any], dict[str, torch.Tensor], LayerInputs | None]:
    """Process (or restore) one layer; return its summary, kept tensors and the next layer's inputs."""
    with computing_in(layer, calib_dtype or next(layer.parameters()).dtype) as master:
        job = None
        if done is not None:
            summary, tensors = done
            summary = {**summary, "resumed": True}
        else:
            job = LayerJob(i, layer, inputs, device, arch, master=master)
            summary, tensors = process(job)
        next_inputs = None
        if inputs is not None:
            batches = job.output_batches if job is not None else None  # a one-pass method already ran the layer
            next_inputs = (LayerInputs.of_batches(batches, inputs.kwargs) if batches is not None
                           else LayerInputs(forward_layer(layer, inputs, device), inputs.kwargs))
    if job is not None:
        tensors = sink.finish(i, layer, summary, tensors)  # the master weights, after computing_in
    return summary, tensors, next_inputs


def _paths(state_dir: Path, i: int) -> tuple[Path, Path]:
    return state_dir / f"layer_{i:04d}.safetensors", state_dir / f"layer_{i:04d}.json"


def _save(state_dir: Path | None, i: int, layer: nn.Module, summary: dict, tensors: dict[str, torch.Tensor]) -> None:
    if state_dir is None:
        return
    weights, meta = _paths(state_dir, i)
    flat = {f"state.{k}": v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
    flat.update({f"kept.{k}": v.detach().cpu().contiguous() for k, v in tensors.items()})
    tmp = weights.with_suffix(".tmp")
    save_file(flat, str(tmp))
    tmp.rename(weights)
    meta.write_text(json.dumps(summary, default=float))  # written last: marks the layer as finished


def _restore(state_dir: Path | None, i: int, layer: nn.Module) -> tuple[dict, dict[str, torch.Tensor]] | None:
    if state_dir is None:
        return None
    weights, meta = _paths(state_dir, i)
    if not (meta.is_file() and weights.is_file()):
        return None
    flat = load_file(str(weights))
    device = next(layer.parameters()).device
    layer.load_state_dict({k[6:]: v for k, v in flat.items() if k.startswith("state.")})
    layer.to(device)
    tensors = {k[5:]: v for k, v in flat.items() if k.startswith("kept.")}
    return json.loads(meta.read_text()), tensors
