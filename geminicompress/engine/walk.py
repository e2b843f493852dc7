"""The walk: every decoder layer in order, each fed the modified previous one (the one engine's loop).

The GPTQ paper's memory-bounded scheme, for every method and every run, in memory or streamed:
1. run the calibration windows through the model up to decoder layer 0 and keep its inputs;
2. for each layer: take it from the *source* (a model in memory: `ModelLayers`; a checkpoint read one
   layer at a time: `models.lazy.LazyLayers`), move it to the compute device, let the method's per-layer
   function (`LayerFn`, layers.py) collect what it needs from the layer's inputs and modify the layer,
   run the *modified* layer over the inputs to get the next layer's inputs, and hand the finished layer
   to the *sink* (sinks.py: it stays in the model, resumable; or it is written into OUT and dropped).
Only one decoder layer and one set of activations are on the device at a time.

Resumable: a sink knows which layers are finished; a restarted run restores them (the layer's weights and
the tensors the method kept) and recomputes the activations through them instead of storing activations.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn as nn

from geminicompress.core.arch import Arch, arch_for, get_module, outside_modules, set_module, tied_output
from geminicompress.engine.layers import (
    LayerFn,
    LayerInputs,
    LayerJob,
    capture_inputs,
    computing_in,
    forward_layer,
    move_outside_layers,
)
from geminicompress.engine.outside_float32 import Float32Gather
from geminicompress.engine.sinks import ResidentSink
from geminicompress.formats.shards import ShardWriter
from geminicompress.host.memory import heap_reuse, release_free_heap
from geminicompress.models.finite import NonFiniteError, nonfinite
from geminicompress.host.progress import NullProgress, Progress


class LayerSource(Protocol):
    """Where the decoder layers come from: `ModelLayers` (a model in memory) or `models.lazy.LazyLayers`
    (read from disk one at a time)."""

    model: nn.Module

    def __len__(self) -> int: ...

    def load(self, i: int) -> nn.Module: ...  # layer i, with its weights, on the CPU

    def release(self, i: int) -> None: ...  # done with layer i

    def capture_modules(self) -> list[str]: ...  # modules outside the layers a forward up to layer 0 needs

    def outside_modules(self) -> list[str]: ...  # the modules holding parameters outside the layers

    def load_outside(self, name: str) -> nn.Module: ...

    def release_outside(self, name: str) -> None: ...


class LayerSink(Protocol):
    """Where finished layers go (sinks.py): `ResidentSink` (they stay in the model; resumable copies in a
    state folder) or `ShardSink` (written into output shards, then dropped)."""

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

    def outside_modules(self) -> list[str]:
        return outside_modules(self.model)

    @property
    def tied_output(self) -> str | None:
        return tied_output(self.model)

    def load_outside(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def tensors(self, names: list[str]) -> list[torch.Tensor]:
        """The named parameters themselves (a pre-pass reads them, e.g. the global magnitude threshold)."""
        return [self.model.get_parameter(n) for n in names]

    def reading_in(self, dtype: torch.dtype | None) -> "ModelLayers":
        """The same layers for a pass that computes in `dtype` (a model in memory is held as it is)."""
        return self

    def release_outside(self, name: str) -> None:
        return None


def nothing(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The per-layer function that changes nothing (a forward through the layers; the walk that writes OUT)."""
    return {}, {}


@dataclass
class Walk:
    """What a walk leaves: the per-layer summaries, the tensors the sink kept of all layers ("<layer>.<name>",
    as the method named them, e.g. "3.self_attn.q_proj.q"), and the inputs of the layer after the last one
    (the model's final hidden states on the windows; None without windows)."""

    summaries: list[dict[str, Any]]
    kept: dict[str, torch.Tensor]
    inputs: LayerInputs | None


@dataclass(frozen=True)
class WalkOptions:
    """How `run_layerwise` walks the layers.

    device: where each layer computes. state_dir: where the default sink keeps finished layers for resuming.
    calib_dtype: the dtype the layers compute in during calibration (None: their own). With a lower one,
    the per-layer function must read and write weights through `LayerJob.weight`/`set_weight`.
    sink: where finished layers go (default: they stay in the model, saved in `state_dir` for resuming:
    sinks.ResidentSink).
    batch: windows per call when a layer runs its inputs into the next layer's (1: one window at a time,
    what every calibrated method sees; a method's own passes choose their own).
    stores: two (n, T, hidden) tensors (possibly memory-mapped files) that hold the activations between the
    layers, used in turn: the walk's memory is then theirs, whatever n is (a forward of many windows).
    check_activations: stop in one line naming the layer and the window when a layer's outputs on a
    calibration window hold NaN/Inf (statistics of them would be NaN; a forward that only measures, off).
    """

    device: torch.device
    progress: Progress | None = None
    state_dir: Path | None = None
    description: str = "layers"
    calib_dtype: torch.dtype | None = None
    sink: LayerSink | None = None
    batch: int = 1
    stores: tuple[torch.Tensor, torch.Tensor] | None = None
    check_activations: bool = True


@dataclass(frozen=True)
class _Walker:
    """What every layer of one walk shares."""

    process: LayerFn
    arch: Arch
    sink: LayerSink
    opts: WalkOptions


def run_layerwise(model: nn.Module | LayerSource, windows: torch.Tensor | None, process: LayerFn,
                  options: WalkOptions) -> Walk:
    """Apply `process` to every decoder layer in order, feeding each layer the modified previous one.

    model: a model in memory, or a `LayerSource` (e.g. layers read from disk one at a time).
    windows: calibration windows (n, T); None for a method that needs no activations (the layers are
    then not run at all, and `LayerJob.inputs` is None).
    options: how the walk goes (`WalkOptions`: at least its device).
    """
    opts = options
    progress = opts.progress or NullProgress()
    source = model if not isinstance(model, nn.Module) else ModelLayers(model)
    sink = opts.sink or ResidentSink(source.model, ShardWriter(opts.state_dir) if opts.state_dir is not None else None)
    walker = _Walker(process, arch_for(source.model), sink, opts)
    layers = get_module(source.model, walker.arch.layers)
    inputs = _first_inputs(source, windows, opts.device, opts.calib_dtype, opts.stores, opts.check_activations)
    # a resumed run whose sink kept the exact inputs of its first unfinished layer starts from them
    skip, kept_inputs = _kept_inputs(sink, len(source), inputs)
    if inputs is not None and skip == 0 and hasattr(sink, "keep_inputs") and not sink.finished(0):
        sink.keep_inputs(0, inputs)
    summaries: list[dict[str, Any]] = []
    kept: dict[str, torch.Tensor] = {}
    with progress.task(opts.description, total=len(source)) as bar, heap_reuse():
        for i in range(len(source)):
            if sink.finished(i) and ((inputs is None and not sink.restores_weights) or i < skip):
                summary, tensors = _skipped(sink, i)  # nothing to run it for
                if i == skip - 1:
                    inputs = kept_inputs
            else:
                summary, tensors, inputs = _through(walker, source, i, inputs)
            kept.update({f"{i}.{k}": v for k, v in tensors.items()})
            summaries.append({"layer": i, **summary})
            release_free_heap()  # the layer's freed small buffers leave resident memory (memory.py)
            bar.advance(1, **{k: v for k, v in summary.items()
                              if isinstance(v, (int, float)) and k not in ("layer", "layer_seconds")})
    move_outside_layers(source.model, layers, torch.device("cpu"))
    return Walk(summaries, kept, inputs)


def _skipped(sink: LayerSink, i: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A finished layer that need not run: its summary and kept tensors, as the finished run left them."""
    summary, tensors = sink.restore(i, None)
    summary = {**summary, "resumed": True}
    summary.pop("forward_batch", None)
    return summary, tensors


def _through(walker: _Walker, source: LayerSource, i: int, inputs: LayerInputs | None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor], LayerInputs | None]:
    """Layer i loaded onto the device, processed (or restored when finished), run over its inputs, released."""
    device, stores = walker.opts.device, walker.opts.stores
    t0 = time.perf_counter()
    inputs = inputs.at(i) if inputs is not None else None  # with the arguments the model gives layer i
    layer = source.load(i).to(device)
    done = walker.sink.restore(i, layer) if walker.sink.finished(i) else None
    into = None if stores is None else stores[(i + 1) % 2]
    summary, tensors, inputs = _one_layer(walker, i, layer, inputs, done, into)
    layer.to("cpu" if device.type != "cpu" else device)
    source.release(i)
    if done is None:
        summary = {**summary, "layer_seconds": round(time.perf_counter() - t0, 3)}
    return summary, tensors, inputs


def _first_inputs(source: LayerSource, windows: torch.Tensor | None, device: torch.device,
                  calib_dtype: torch.dtype | None, stores: tuple[torch.Tensor, torch.Tensor] | None,
                  check: bool) -> LayerInputs | None:
    """Layer 0's inputs on the windows (None without windows), in the walk's stores when it has them."""
    if windows is None:
        return None
    inputs = (_capture(source, windows, device, calib_dtype) if stores is None else
        capture_into(source, windows, stores[0], device, calib_dtype or torch.float32))
    if check:
        check_activations_of(inputs, "the embeddings")
    return inputs


def _capture(source: LayerSource, windows: torch.Tensor, device: torch.device,
             calib_dtype: torch.dtype | None) -> LayerInputs:
    """The inputs of decoder layer 0, with the modules the source must provide for it loaded meanwhile
    (computed in float32, as a model in memory holds them: the embeddings' outputs are then the same)."""
    storage = activation_storage(windows, source.model.config.hidden_size, calib_dtype or torch.float32, device)
    with embeddings_read(source):
        return capture_inputs(source.model, windows, device, storage, dtype=calib_dtype)


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


def _one_layer(walker: _Walker, i: int, layer: nn.Module, inputs: LayerInputs | None, done: tuple | None,
               into: torch.Tensor | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], LayerInputs | None]:
    """Process (or restore) one layer; return its summary, kept tensors and the next layer's inputs."""
    opts, sink, batch = walker.opts, walker.sink, walker.opts.batch
    # a layer may hold no parameters (OLMo's norms have none; its linears made INT8 hold buffers)
    with computing_in(layer, opts.calib_dtype or next((p.dtype for p in layer.parameters()), torch.float32)) as master:
        job = None
        if done is not None:
            summary, tensors = done
            summary = {**summary, "resumed": True}
            batch = summary.pop("forward_batch", batch)  # recomputed as the finished run computed them: bitwise
        else:
            job = LayerJob(i, layer, inputs, opts.device, walker.arch, master=master)
            summary, tensors = walker.process(job)
        next_inputs = None
        if inputs is not None:
            batches = job.output_batches if job is not None else None  # a one-pass method already ran the layer
            if batches is not None:
                batch = batches[0].shape[0]
                if into is not None:  # into the walk's activation store
                    starts = accumulate((b.shape[0] for b in batches), initial=0)
                    batches = [into[s:s + b.shape[0]].copy_(b) for s, b in zip(starts, batches)]
            next_inputs = LayerInputs.of_batches(batches if batches is not None else
                                                 forward_layer(layer, inputs, opts.device, batch=batch, into=into),
                                                 inputs.kwargs, inputs.layer_kwargs)
            if opts.check_activations:
                check_activations_of(next_inputs, f"decoder layer {i}")
    if job is not None:
        if next_inputs is not None and hasattr(sink, "keep_inputs"):
            sink.keep_inputs(i + 1, next_inputs)  # before the layer is finished: a finished layer's successor has them
        # the sink records how the next layer's inputs were computed (a resumed run recomputes them the same way)
        tensors = sink.finish(i, layer, {**summary, **({"forward_batch": batch} if inputs is not None else {})},
                              tensors)  # the master weights, after computing_in
    return summary, tensors, next_inputs


def _kept_inputs(sink: Any, n: int, inputs: LayerInputs | None) -> tuple[int, LayerInputs | None]:
    """(k, the exact inputs of layer k) when layers 0..k-1 are finished and the sink kept layer k's inputs
    (a streamed run whose written layers do not give them back exactly: sinks.InputsKeeper), else (0, None)."""
    if inputs is None or not hasattr(sink, "kept_inputs"):
        return 0, None
    k = 0
    while k < n and sink.finished(k):
        k += 1
    batches = sink.kept_inputs(k) if k else None
    return (k, LayerInputs.of_batches(batches, inputs.kwargs, inputs.layer_kwargs)) if batches is not None else (0, None)


def check_activations_of(inputs: LayerInputs, after: str) -> None:
    """One line naming the window and where, when a calibration window's activations hold NaN/Inf."""
    for w, h in enumerate(inputs.hidden):
        hit = nonfinite(h)
        if hit is not None:
            raise NonFiniteError(f"calibration window {w}: the activations after {after} hold {hit[0]:,} non-finite "
                                 f"values (the first at {hit[1][1:]}): they overflow in the dtype the layers compute "
                                 "in; calibrate in float32 (--calib-dtype float32), on other text, or check the model")


def capture_into(source: LayerSource, windows: torch.Tensor, into: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, stored: torch.dtype = torch.float32, chunk: int = 8) -> LayerInputs:
    """Layer 0's inputs of every window, written into `into` (n, T, d) `chunk` windows at a time (bounding the
    capture's own temporaries). The modules a forward up to layer 0 needs (the embeddings) are read meanwhile,
    computed in float32 as a model in memory holds them (rounded to `stored` first); an embedding table held in
    a lower precision stays so, and only the rows looked up are made float32 (outside_float32.py)."""
    first: LayerInputs | None = None
    with embeddings_read(source, stored):
        for b in range(0, windows.shape[0], chunk):
            captured = capture_inputs(source.model, windows[b:b + chunk], device, dtype=dtype)
            into[b:b + chunk].copy_(torch.cat([h.to("cpu") for h in captured.hidden]))
            first = first or captured
    return LayerInputs.of_store(into, first.kwargs, layer_kwargs=first.layer_kwargs)


def walk_outside(source: LayerSource, hooks: list[Callable[[str, nn.Module], Any]], sink: Any) -> list[dict]:
    """After the layers: every module outside them (embeddings, final norm, head; a tied head is not stored)
    read one at a time, passed through the stages' `outside(name, module) -> (module, row) | None` hooks
    in order, and handed to the sink. Returns the hooks' rows (report.json), those of a resumed run too."""
    rows: list[dict] = []
    for name in source.outside_modules():
        if name == source.tied_output:
            continue
        done = sink.outside_done(name)
        if done is not None:
            rows += done
            continue
        module = source.load_outside(name)
        mine = []
        for hook in hooks:
            changed = hook(name, module)
            if changed is not None:
                module, row = changed
                mine.append(row)
        sink.outside(name, module, mine)
        rows += mine
        source.release_outside(name)
    return rows


@contextmanager
def embeddings_read(source: LayerSource, stored: torch.dtype = torch.float32) -> Iterator[None]:
    """The modules a forward up to decoder layer 0 needs (the embeddings), read from a lazy source for the
    duration and computed in float32 as a model in memory holds them (rounded to `stored` first). An embedding
    table held in a lower precision stays so and only the rows looked up are made float32
    (outside_float32.Float32Gather: the same values; a float32 copy of a 262,144-token table at hidden 4,096
    is 4 GiB). A source in memory provides them itself: nothing to do."""
    loaded = source.capture_modules()
    ckpt = getattr(source, "ckpt", None)
    gathered = {}
    for name in loaded:
        table = isinstance(get_module(source.model, name), nn.Embedding)  # read as stored when float32 is asked:
        module = ckpt.materialise(name, None if table and stored == torch.float32 else stored)  # the same values
        if table and module.weight.dtype != torch.float32:  # only the rows looked up are made float32
            gathered[name] = module
            set_module(source.model, name, Float32Gather(module))
        else:
            module.float()
    try:
        yield
    finally:
        for name in loaded:
            if name in gathered:
                set_module(source.model, name, gathered[name])
            ckpt.release(name)
