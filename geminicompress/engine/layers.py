"""What a method sees of one decoder layer, and the primitives of the layer-by-layer walk (walk.py).

- `capture_inputs`: run calibration windows up to decoder layer 0 and keep that layer's inputs;
- `LayerInputs`: one layer's inputs for every window (views of batch tensors when known);
- `forward_layer` / `layer_output`: run a layer over them, with hooks that observe its modules;
- `LayerJob`: one layer, its inputs and the device, as a method's per-layer function (`LayerFn`) gets it,
  with `one_pass` (onepass.py) for group-sequential solving in one pass over the windows;
- `computing_in`: the layer computes in a lower dtype (bfloat16) while its float32 master weights stay
  what a method reads and writes (`LayerJob.weight` / `set_weight`), so what it solves and exports is not
  rounded to bfloat16. Statistics from bfloat16 activations (Hessians) are still float32 (hessian.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from geminicompress.core.arch import Arch, arch_for, get_module
from geminicompress.engine.onepass import one_pass
from geminicompress.host.memory import release_free_heap

BATCH_WINDOWS = 4  # calibration windows per forward batch


class StopForward(Exception):
    """Raised by a hook to end a layer's (or model's) forward once what it observes has run."""


@dataclass
class LayerInputs:
    """Inputs of one decoder layer for every calibration window.

    hidden: list of (1, T, d) tensors (kept on `storage`, the CPU unless asked otherwise);
    kwargs: the keyword arguments the model passes *this* decoder layer (rotary embeddings, mask, position
    ids), already on the compute device; the same for all windows of equal length;
    layer_kwargs: those of every decoder layer, captured during one real forward (Gemma 2 and 3 hand their
    sliding-window and global layers different masks and rotary embeddings): `at(i)` is layer i's.
    """

    hidden: list[torch.Tensor]
    kwargs: dict[str, Any]
    batches: list[torch.Tensor] | None = None  # (b, T, d) tensors that `hidden` are views of, when known
    layer_kwargs: list[dict[str, Any]] | None = None

    @classmethod
    def of_batches(cls, batches: list[torch.Tensor], kwargs: dict[str, Any],
                   layer_kwargs: list[dict[str, Any]] | None = None) -> LayerInputs:
        """Inputs kept as (b, T, d) batch tensors, with every window a (1, T, d) view of them (no copy)."""
        return cls([y.unsqueeze(0) for b in batches for y in b], kwargs, batches, layer_kwargs)

    @classmethod
    def of_store(cls, store: torch.Tensor, kwargs: dict[str, Any], batch: int = BATCH_WINDOWS,
                 layer_kwargs: list[dict[str, Any]] | None = None) -> LayerInputs:
        """Inputs held in one (n, T, d) tensor (possibly a memory-mapped file), as views of it."""
        return cls.of_batches([store[b:b + batch] for b in range(0, store.shape[0], batch)], kwargs, layer_kwargs)

    def at(self, i: int) -> LayerInputs:
        """The same windows as decoder layer i's inputs (with the keyword arguments the model gives layer i)."""
        if self.layer_kwargs is None or i >= len(self.layer_kwargs):
            return self
        return LayerInputs(self.hidden, self.layer_kwargs[i], self.batches, self.layer_kwargs)

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


def move_outside_layers(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
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


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache")


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer was called with (first positional argument, or `hidden_states=`)."""
    return args[0] if args else kwargs["hidden_states"]


def as_layer_output(hidden: torch.Tensor, output_tuple: int) -> Any:
    """`hidden` as a decoder layer of the architecture returns its hidden states (arch.output_tuple: 0 = bare)."""
    return hidden if not output_tuple else (hidden,) + (None,) * (output_tuple - 1)


@contextmanager
def recording_layers(layers: nn.ModuleList, output_tuple: int, record: Callable[[int, tuple, dict], bool]
                     ) -> Iterator[None]:
    """Every decoder layer replaced (its `forward`, on the instance: the model still sees the layer's own
    attributes) by a stub that hands its arguments to `record(i, args, kwargs)` and passes the hidden states
    on unchanged; a stub whose `record` returns True ends the model's forward (StopForward)."""

    def stub(i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if record(i, args, kwargs):
                raise StopForward
            return as_layer_output(layer_input(args, kwargs), output_tuple)
        return forward

    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@torch.no_grad()
def capture_inputs(model: nn.Module, windows: torch.Tensor, device: torch.device,
                   storage: torch.device = torch.device("cpu"), dtype: torch.dtype | None = None) -> LayerInputs:
    """Run each window (n, T) up to decoder layer 0 and record that layer's inputs (floating tensors cast
    to `dtype` when given: the dtype the layers will compute in), and, on the first window, the keyword
    arguments the model hands every decoder layer (`LayerInputs.layer_kwargs`)."""
    arch = arch_for(model)
    layers = get_module(model, arch.layers)
    move_outside_layers(model, layers, device)
    hidden: list[torch.Tensor] = []
    per_layer: list[dict[str, Any]] = []

    def record(i: int, args: tuple, kwargs: dict) -> bool:
        if i == 0:
            h = layer_input(args, kwargs)
            hidden.append(h.detach().to(storage, dtype or h.dtype))
            if len(hidden) > 1:  # the other windows: layer 0's inputs only
                return True
        per_layer.append({k: v for k, v in kwargs.items() if k != "hidden_states" and k not in _CACHE_KWARGS})
        return i == len(layers) - 1

    with recording_layers(layers, arch.output_tuple, record):
        for row in windows:
            try:
                model(row.unsqueeze(0).to(device), use_cache=False)
            except StopForward:
                pass
    moved: dict[int, Any] = {}  # one copy per tensor the layers share (layers of one type get the same mask)

    def to(value: Any) -> Any:
        if id(value) not in moved:
            moved[id(value)] = (value, _to(value, device, dtype))
        return moved[id(value)][1]

    layer_kwargs = [{k: to(v) for k, v in kw.items()} for kw in per_layer]
    batches = LayerInputs(hidden, layer_kwargs[0]).batched(BATCH_WINDOWS, storage)
    hidden.clear()  # the per-window copies; the windows become views of the batches
    return LayerInputs.of_batches(batches, layer_kwargs[0], layer_kwargs)


def layer_output(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def forward_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device,
                  observe: dict[nn.Module, Callable[[torch.Tensor, torch.Tensor], None]] | None = None,
                  keep_outputs: bool = True, batch: int = 1, into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Run the layer over every window, `batch` windows per call; `observe[module](x, y)` sees each module's
    input x and output y (x: (batch, T, in) on the device). Returns the layer outputs, (batch, T, d) each, on
    the inputs' storage device, or views of `into` ((n, T, d): written there, e.g. a memory-mapped file)."""
    handles = [module.register_forward_hook(lambda m, a, y, fn=fn: fn(a[0].detach(), y.detach()))
               for module, fn in (observe or {}).items()]
    outs: list[torch.Tensor] = []
    start = 0
    try:
        for h in (inputs.hidden if batch == 1 else inputs.batched(batch, inputs.hidden[0].device)):
            y = layer_output(layer, h.to(device), inputs.kwargs)
            if into is not None:
                outs.append(into[start:start + y.shape[0]])
                outs[-1].copy_(y)
            elif keep_outputs:
                outs.append(y.to(h.device))
            start += y.shape[0]
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
