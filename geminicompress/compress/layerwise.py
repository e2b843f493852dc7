"""Layer-by-layer calibration, shared by GPTQ, AWQ, SparseGPT and Wanda (and anything alike).

The GPTQ paper's memory-bounded scheme:
1. run the calibration windows through the model up to decoder layer 0 and keep its inputs;
2. for each layer: move it to the compute device, let the method collect what it needs from the
   layer's inputs (hooks on its linears, `forward`) and modify the layer, then run the *modified*
   layer over the inputs to get the next layer's inputs; move it back.
Only one decoder layer and one set of activations are on the device at a time.

Calibration dtype: the layer may compute in bfloat16 (`calib_dtype`) while its weights stay float32:
the forward passes and the activations between layers are bfloat16 (about 1.7x faster matmuls on a CPU
with AVX512-BF16, half the activation memory), while a method reads and writes the float32 master weights
through `LayerJob.weight`/`set_weight`, so what it solves and exports is not rounded to bfloat16.
Statistics taken from the bfloat16 activations (Hessians) are still computed in float32 (hessian.py).

Resumable: after each layer, its weights (and any tensors the method wants to keep, e.g. integer codes
for packing) go to `state_dir/layer_XXXX.safetensors` with a JSON summary. A restarted run restores the
finished layers and recomputes the activations through them (cheap next to the solver) instead of
storing activations on disk.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from geminicompress.compress.arch import Arch, arch_for, get_module
from geminicompress.compress.onepass import one_pass
from geminicompress.memory import heap_reuse, release_free_heap
from geminicompress.progress import NullProgress, Progress


BATCH_WINDOWS = 4  # calibration windows per forward batch


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    """Inputs of one decoder layer for every calibration window.

    hidden: list of (1, T, d) tensors (kept on `storage`, the CPU unless asked otherwise);
    kwargs: the keyword arguments the model passes to every decoder layer (rotary embeddings,
    mask, position ids), already on the compute device; the same for all windows of equal length.
    """

    hidden: list[torch.Tensor]
    kwargs: dict[str, Any]
    batches: list[torch.Tensor] | None = None  # (b, T, d) tensors that `hidden` are views of, when known

    @classmethod
    def of_batches(cls, batches: list[torch.Tensor], kwargs: dict[str, Any]) -> LayerInputs:
        """Inputs kept as (b, T, d) batch tensors, with every window a (1, T, d) view of them (no copy)."""
        return cls([y.unsqueeze(0) for b in batches for y in b], kwargs, batches)

    def batched(self, size: int, device: torch.device) -> list[torch.Tensor]:
        """The windows as (size, T, d) batches on the device: the stored batch tensors themselves when they
        have that size (no copy), else concatenated."""
        if self.batches is not None and all(b.shape[0] == size for b in self.batches[:-1]):
            return [b.to(device) for b in self.batches]
        h = self.hidden
        return [torch.cat([x.to(device) for x in h[i:i + size]]) for i in range(0, len(h), size)]


def _to(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """value on device; its floating tensors (rotary cos/sin, an additive mask) also in dtype when given."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if dtype is not None and value.is_floating_point() else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device, dtype) for v in value)
    return value


@contextmanager
def computing_in(layer: nn.Module, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor] | None]:
    """Run the layer in `dtype` inside the block; yields the float parameters it had ({name: tensor}, the
    master copies a method updates), or None when the layer already computes in dtype. Afterwards the
    layer holds the master tensors again (with whatever the method wrote into them)."""
    params = dict(layer.named_parameters())
    if all(p.dtype == dtype for p in params.values()):
        yield None
        return
    master = {n: p.data for n, p in params.items()}
    buffers = {n: b for n, b in layer.named_buffers()}
    layer.to(dtype)
    try:
        yield master
    finally:
        for n, p in params.items():
            p.data = master[n]
        for n, b in buffers.items():
            owner, _, leaf = n.rpartition(".")
            layer.get_submodule(owner)._buffers[leaf] = b


def _move_outside_layers(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Move embeddings, rotary buffers, final norm, head: everything except the decoder layers."""
    inside = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:  # a lazy model's modules that are not loaded stay where they are
                param.data = param.data.to(device)
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buf.to(device)


@torch.no_grad()
def capture_inputs(model: nn.Module, windows: torch.Tensor, device: torch.device,
                   storage: torch.device = torch.device("cpu"), dtype: torch.dtype | None = None) -> LayerInputs:
    """Run each window (n, T) up to decoder layer 0 and record that layer's inputs (floating tensors cast
    to `dtype` when given: the dtype the layers will compute in)."""
    layers = get_module(model, arch_for(model).layers)
    _move_outside_layers(model, layers, device)
    hidden: list[torch.Tensor] = []
    captured: dict[str, Any] = {}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        hidden.append(h.detach().to(storage, dtype or h.dtype))
        if not captured:
            captured.update({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for row in windows:
            try:
                model(row.unsqueeze(0).to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    for key in ("cache", "past_key_values", "past_key_value", "use_cache"):
        captured.pop(key, None)
    kwargs = {k: _to(v, device, dtype) for k, v in captured.items()}
    batches = LayerInputs(hidden, kwargs).batched(BATCH_WINDOWS, storage)
    del hidden  # the per-window copies; the windows become views of the batches
    return LayerInputs.of_batches(batches, kwargs)


def layer_output(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def forward_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device,
                  observe: dict[nn.Module, Callable[[torch.Tensor, torch.Tensor], None]] | None = None,
                  keep_outputs: bool = True) -> list[torch.Tensor]:
    """Run the layer over every window; `observe[module](x, y)` sees each module's input x and output y
    (x: (1, T, in) on the device). Returns the layer outputs (on the inputs' storage device)."""
    handles = []
    for module, fn in (observe or {}).items():
        handles.append(module.register_forward_hook(lambda m, a, y, fn=fn: fn(a[0].detach(), y.detach())))
    outs: list[torch.Tensor] = []
    try:
        for h in inputs.hidden:
            y = layer_output(layer, h.to(device), inputs.kwargs)
            if keep_outputs:
                outs.append(y.to(h.device))
    finally:
        for handle in handles:
            handle.remove()
    return outs


@dataclass
class LayerJob:
    """What a method sees for one layer: call `forward(observe)` as often as it needs."""

    index: int
    layer: nn.Module
    inputs: LayerInputs
    device: torch.device
    arch: Arch
    output_batches: list[torch.Tensor] | None = None  # set by `one_pass`: the next layer's inputs, (b, T, d)
    master: dict[str, torch.Tensor] | None = None  # float32 parameters while the layer computes in a lower dtype

    def forward(self, observe: dict[nn.Module, Callable[[torch.Tensor, torch.Tensor], None]] | None = None,
                keep_outputs: bool = False) -> list[torch.Tensor]:
        return forward_layer(self.layer, self.inputs, self.device, observe, keep_outputs)

    def module(self, name: str) -> nn.Module:
        return get_module(self.layer, name)

    @property
    def outputs(self) -> list[torch.Tensor] | None:
        """The one-pass outputs per window, (1, T, d) views of `output_batches`; None before `one_pass`."""
        return None if self.output_batches is None else LayerInputs.of_batches(self.output_batches, {}).hidden

    def weight(self, name: str) -> torch.Tensor:
        """Linear `name`'s weight at full precision (the master copy when the layer computes in bfloat16)."""
        return self.master[f"{name}.weight"] if self.master is not None else self.module(name).weight.data

    def set_weight(self, name: str, value: torch.Tensor) -> None:
        """Write a solved weight into the master copy and into the weight the layer computes with."""
        self.weight(name).copy_(value)
        if self.master is not None:
            self.module(name).weight.data.copy_(value)

    def one_pass(self, groups: list[list[str]], observe: Callable[[int, torch.Tensor], None],
                 solve: Callable[[int], None], batch: int = BATCH_WINDOWS) -> None:
        """Solve the groups of linears (names, in execution order) in one pass over the windows
        (onepass.py): observe(g, x) sees group g's input for every batch of windows, solve(g) runs once
        all have, before group g computes anything. The solved layer's outputs become `self.output_batches`."""
        batches = self.inputs.batched(batch, self.device)

        def trimmed_solve(g: int) -> None:
            # the paused batches' freed temporaries (attention's q/k/v, ...) leave holes in the heap that
            # stay resident; hand them back before the solver's big buffers (memory.py)
            release_free_heap()
            solve(g)

        results = one_pass(lambda h: layer_output(self.layer, h, self.inputs.kwargs), batches,
                           [[self.module(n) for n in g] for g in groups], observe, trimmed_solve)
        storage = self.inputs.hidden[0].device
        self.output_batches = [out.to(storage) for out in results]


# A method processes one layer in place and returns (summary for report.json, tensors to keep).
LayerFn = Callable[[LayerJob], tuple[dict[str, Any], dict[str, torch.Tensor]]]


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
    _move_outside_layers(source.model, layers, torch.device("cpu"))
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


@contextmanager
def solver_threads(device: torch.device) -> Iterator[None]:
    """One CPU thread for a column-by-column solver written in torch ops (SparseGPT): its loop is thousands of
    ops on (out,)-sized vectors, where a second thread only adds synchronisation (measured: 0.25 s vs 6 s
    for a 1536x576 weight on a busy 2-core machine). GPUs are unaffected. (GPTQ's column loop runs on
    numpy on the CPU and needs no such limit: gptq/solver.py.)"""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def iter_linears(layer: nn.Module, arch: Arch) -> Iterator[tuple[str, nn.Linear]]:
    for name in arch.linears:
        yield name, get_module(layer, name)
