"""Logits of many windows from a model read one decoder layer at a time (memory follows one layer).

Every window goes through decoder layer 0, then every window through layer 1, and so on: the engine's
one walk (engine/walk.py), with nothing done to the layers, so only one layer's weights are in memory at a time.
What grows with the number of windows is their activations, held twice (a layer's inputs and its
outputs, (n, T, d) each): in memory, or with `spill_dir` in two files mapped into memory, which the
kernel writes out and drops under memory pressure ("activations on disk when they do not fit").

The final norm and the output head then run window batch by window batch through the model's *own*
forward (`_head_only`), so whatever the model does after its layers (final norm, head, logit soft-capping)
is exactly what transformers does. The probe that checks OUT (verify.py) uses `embed` (layer 0's inputs,
the embeddings read as stored) and `through_layer` (one finished layer as written) too.

Users: `eval --stream` (perplexity and KL of a model bigger than memory), the check of OUT after a
streamed run, and distill's teacher top-k cache for a teacher bigger than memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from geminicompress.core.arch import arch_for, get_module, set_module
from geminicompress.engine.outside_float32 import Float32Rows
from geminicompress.engine.layers import computing_in, layer_output
from geminicompress.engine.walk import LayerSource, ModelLayers, capture_into, nothing, run_layerwise, WalkOptions
from geminicompress.host.progress import NullProgress, Progress

HeadTransform = Callable[[str, nn.Module], nn.Module]  # (module name, module as read) -> module to compute with


class ActivationStore:
    """The (n, T, d) activations of every window at one depth, in memory or in a memory-mapped file."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, path: Path | None = None) -> None:
        self.path = path
        numel = shape[0] * shape[1] * shape[2]
        if path is None:
            self.tensor = torch.empty(shape, dtype=dtype)
        else:
            path.unlink(missing_ok=True)
            self.tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)

    def close(self) -> None:
        """Drop the activations (and their file)."""
        self.tensor = torch.empty(0)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def activations_bytes(windows: torch.Tensor, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one ActivationStore for `windows` (n, T): the forward holds two."""
    return windows.numel() * hidden * dtype.itemsize


class StreamedHidden:
    """The hidden states of every window at one depth (after the last decoder layer, before the final norm;
    or layer 0's inputs) and the keyword arguments the model passes each decoder layer (rotary embeddings,
    mask: `layer_kwargs[i]` is layer i's, captured in a real forward)."""

    def __init__(self, store: ActivationStore, layer_kwargs: list[dict[str, Any]]) -> None:
        self.store, self.layer_kwargs = store, layer_kwargs

    @property
    def tensor(self) -> torch.Tensor:
        return self.store.tensor  # (n, T, d)

    def close(self) -> None:
        self.store.close()


@torch.no_grad()
def final_hidden(source: nn.Module | LayerSource, windows: torch.Tensor, *, device: torch.device,
                 dtype: torch.dtype = torch.float32, batch: int = 4, spill_dir: Path | None = None,
                 progress: Progress | None = None, description: str = "layers") -> StreamedHidden:
    """Run `windows` (n, T) through every decoder layer of `source`, one layer at a time (the engine's walk,
    with nothing done to the layers), computing in `dtype`, `batch` windows per call; the activations are
    two (n, T, d) stores in `dtype` (files under `spill_dir` when given)."""
    source = source if not isinstance(source, nn.Module) else ModelLayers(source)
    files = [spill_dir / f"activations-{k}.bin" for k in (0, 1)] if spill_dir is not None else [None, None]
    shape = (windows.shape[0], windows.shape[1], source.model.config.hidden_size)
    stores = [ActivationStore(shape, dtype, f) for f in files]
    walked = run_layerwise(source, windows, nothing, WalkOptions(device=device, progress=progress or NullProgress(),
                                                                 description=description, calib_dtype=dtype,
                                                                 batch=batch,
                                                                 stores=(stores[0].tensor, stores[1].tensor),
                                                                 check_activations=False))
    last = len(source) % 2  # the store the last layer wrote (layer i writes into store (i + 1) % 2)
    stores[1 - last].close()
    return StreamedHidden(stores[last], walked.inputs.layer_kwargs)


@torch.no_grad()
def through_layer(layer: nn.Module, inp: torch.Tensor, out: torch.Tensor, kwargs: dict[str, Any], *,
                  device: torch.device, dtype: torch.dtype, batch: int = 4) -> None:
    """out = layer(inp) for every window, `batch` at a time, the layer computing in `dtype` (its own
    tensors left as they are). inp, out: (n, T, d), may be the same tensor."""
    with computing_in(layer, dtype):
        for b in range(0, inp.shape[0], batch):
            out[b:b + batch].copy_(layer_output(layer, inp[b:b + batch].to(device), kwargs))


@torch.no_grad()
def embed(source: nn.Module | LayerSource, windows: torch.Tensor, *, device: torch.device,
          dtype: torch.dtype = torch.float32, stored: torch.dtype = torch.float32) -> StreamedHidden:
    """Decoder layer 0's inputs of every window (n, T) -> (n, T, d) in `dtype`, with the keyword arguments
    the model passes its decoder layers. A lazy source's embeddings are read rounded to `stored` (as a
    checkpoint in that dtype holds them) and held in float32."""
    source = source if not isinstance(source, nn.Module) else ModelLayers(source)
    shape = (windows.shape[0], windows.shape[1], source.model.config.hidden_size)
    store = ActivationStore(shape, dtype)
    return StreamedHidden(store, capture_into(source, windows, store.tensor, device, dtype, stored).layer_kwargs)


@contextmanager
def _head_only(source: LayerSource, dtype: torch.dtype, device: torch.device,
               transform: HeadTransform | None = None) -> Iterator[tuple[nn.Module, nn.Module]]:
    """The model with its decoder layers swapped for an empty list and its final norm and output head read
    (lazy sources) and on `device` in `dtype`; yields (model, final norm). `transform(name, module)` may
    give a lazy source's module another one to compute with meanwhile (e.g. the INT8 head a streamed run
    made of the checkpoint's), or change a model in memory's in place (its floats rounded as written).
    A lazy source's plain output head, asked for in float32, reaches `transform` as stored (e.g. bfloat16);
    if it stays in a lower precision it is computed in float32 a block of rows at a time (outside_float32.py)
    instead of copied whole into float32."""
    model = source.model
    arch = arch_for(model)
    names = {m: n for n, m in model.named_modules()}
    output = names[model.get_output_embeddings()]
    head = [arch.final_norm, output]
    ckpt = getattr(source, "ckpt", None)
    saved = {n: {k: v for k, v in get_module(model, n).state_dict(keep_vars=True).items()} for n in head}
    read: dict[str, nn.Module] = {}
    for n in head:
        if ckpt is not None:  # read in dtype; a quantized head keeps the dtypes its reader gave it (as loaded)
            # a plain float32 head is read as stored and computed in float32 by blocks of rows (outside_float32.py)
            rows = (n == output and dtype == torch.float32 and type(get_module(model, n)) is nn.Linear
                and n not in ckpt.quantized)
            read[n] = ckpt.materialise(n, None if rows else dtype)
            used = transform(n, read[n]) if transform is not None else read[n]
            if rows and type(used) is nn.Linear and used.weight.dtype != torch.float32:
                used = Float32Rows(used)
            if used is not read[n]:
                set_module(model, n, used)
            used.to(device)
        else:  # a model in memory: `transform` may change its module in place (rounded as stored)
            module = get_module(model, n)
            if transform is not None and transform(n, module) is not module:
                raise ValueError("a model in memory takes a transform that changes its module in place")
            module.to(device, dtype)
    layers = get_module(model, arch.layers)
    set_module(model, arch.layers, nn.ModuleList())
    try:
        yield model, get_module(model, arch.final_norm)
    finally:
        set_module(model, arch.layers, layers)
        for n in head:
            if ckpt is not None:
                set_module(model, n, read[n])
                ckpt.release(n)
            else:
                get_module(model, n).load_state_dict(saved[n], assign=True)


@torch.no_grad()
def head_logits(source: nn.Module | LayerSource, hidden: StreamedHidden, *, device: torch.device,
                dtype: torch.dtype = torch.float32, batch: int = 1,
                transform: HeadTransform | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first window index, logits (b, T, vocab) in float32) for every batch of `batch` windows of `hidden`,
    in order, through the model's own final norm and head (for a lazy source, as `transform` makes them)."""
    source = source if not isinstance(source, nn.Module) else ModelLayers(source)
    n, T, d = hidden.tensor.shape
    current: list[torch.Tensor] = []
    with _head_only(source, dtype, device, transform) as (model, norm):
        handle = norm.register_forward_pre_hook(lambda m, args: (current[0],) + tuple(args[1:]))
        try:
            for b in range(0, n, batch):
                h = hidden.tensor[b:b + batch].to(device, dtype)
                current[:] = [h]
                dummy = torch.zeros(h.shape, dtype=dtype, device=device)  # replaced at the final norm
                logits = model(inputs_embeds=dummy, use_cache=False).logits
                yield b, logits.float()
        finally:
            handle.remove()


@torch.no_grad()
def head_chunks(source: nn.Module | LayerSource, hidden: StreamedHidden, *, device: torch.device, positions: int,
                rows: int, dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(window index, first position, logits (c, V) in float32) of the first `positions` positions of every
    window of `hidden`, `rows` positions at a time, in order, through the model's own final norm and head: a
    window's logits are never held whole (models/head.py says why)."""
    source = source if not isinstance(source, nn.Module) else ModelLayers(source)
    current: list[torch.Tensor] = []
    with _head_only(source, dtype, device) as (model, norm):
        handle = norm.register_forward_pre_hook(lambda m, args: (current[0],) + tuple(args[1:]))
        try:
            for w in range(hidden.tensor.shape[0]):
                for start in range(0, positions, rows):
                    h = hidden.tensor[w:w + 1, start:min(start + rows, positions)].to(device, dtype)  # (1, c, d)
                    current[:] = [h]
                    dummy = torch.zeros(h.shape, dtype=dtype, device=device)  # replaced at the final norm
                    yield w, start, model(inputs_embeds=dummy, use_cache=False).logits[0].float()
        finally:
            handle.remove()


@torch.no_grad()
def streamed_logits(source: nn.Module | LayerSource, windows: torch.Tensor, *, device: torch.device,
                    dtype: torch.dtype = torch.float32, spill_dir: Path | None = None,
                    progress: Progress | None = None, head_batch: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
    """`final_hidden` then `head_logits`: (first window index, logits (b, T, vocab)) for every window."""
    hidden = final_hidden(source, windows, device=device, dtype=dtype, spill_dir=spill_dir, progress=progress)
    try:
        yield from head_logits(source, hidden, device=device, dtype=dtype, batch=head_batch)
    finally:
        hidden.close()
