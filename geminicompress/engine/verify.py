"""Verified on the way out: OUT, loaded back the way a user loads it, reproduces what the run computed.

Probe: 2 windows x 64 token ids drawn with a fixed seed from the tokenizer's vocabulary (no data file).
They are carried through the in-process result as OUT is written, the same way for a model in memory and
for a streamed run: layer 0's inputs from the embeddings, each finished layer as it is written (the sink
calls `Probe.advance` before handing the layer to the writer), then the final norm and head. After OUT is
written into its hidden partial folder, it is loaded back in float32 (in memory by the project's loader
when it fits, else one layer at a time by `models/lazy.py`, the reader `eval --stream` uses) and the
same windows' logits are compared. Beyond the tolerance the run fails in one line before OUT is renamed
into place (output.py): a checkpoint that does not reproduce its model is never left behind.

What is compared with what. The in-process result is taken *as stored*: every float tensor rounded to
the dtype OUT holds (what `--dtype` asks for), except the weights a format stores as integer codes and
scales (gptq, awq, pack-quantized: their writer's `exact_weights`), which dequantize exactly to the
in-process weights.
Both sides then hold identical values, run one window at a time on the same device, and can differ only
in the order of float32 operations (a fused q/k/v GEMM, the dequantization formula): the bound is 1e-4
of the largest |logit| (about 1,700 float32 unit roundoffs; every difference measured so far is 0).
A bound derived from the dtype on the unrounded model could not be that tight: storing the demo's W8A8
model in bfloat16 alone moves its logits by a third of their range (per-token activation quantization
turns the weights' rounding into code flips), more than many a packing bug would. That effect is
measured apart and recorded, not checked: `storage_rounding_diff` (the in-process logits before and
after rounding; null for a streamed run, which carries its layers as stored only). A broken writer or
loader (codes in the wrong order, a transposed or mis-scaled tensor, one module's codes corrupted) moves
the logits far beyond 1e-4. OUT is loaded in float32 so that the precision a user later computes in
stays out of the comparison.

`export.verified` in report.json: {"windows": [2, 64], "max_abs_logit_diff", "max_abs_logit",
"tolerance", "dtype", "storage_rounding_diff", "loaded": "in-memory" | "streamed", "seconds"}.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from geminicompress.core.arch import get_module
from geminicompress.engine.forward import embed, final_hidden, head_logits, through_layer
from geminicompress.engine.layers import computing_in
from geminicompress.core.errors import GeminiError
from geminicompress.host.memory import release_weights
from geminicompress.host.memory import too_big as over
from geminicompress.models.finite import NonFiniteError
from geminicompress.models.headers import is_readable_dir, loaded_bytes
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.models.loading import load_model, local_dir
from geminicompress.host.output import final_name
from geminicompress.host.progress import NullProgress, Progress

WINDOWS, TOKENS, SEED = 2, 64, 0
TOLERANCE = 1e-4  # of the largest |logit|: both sides hold the same values (see above)
HeadModule = Callable[[str, nn.Module], nn.Module]  # what the run writes for a module outside the layers


def probe_windows(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(WINDOWS, TOKENS) token ids drawn with a fixed seed from the ids both the tokenizer and the model know."""
    high = min(len(tokenizer), vocab_size) if tokenizer is not None else vocab_size
    return torch.randint(0, high, (WINDOWS, TOKENS), generator=torch.Generator().manual_seed(SEED))


@torch.no_grad()
def model_logits(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Logits (n, T, vocab) in float32 on the CPU of a model in memory, one window at a time."""
    device = next(model.parameters()).device
    return torch.cat([model(w.view(1, -1).to(device), use_cache=False).logits.float().cpu() for w in windows])


@contextmanager
def weights_made(layers: nn.ModuleList, made: Callable[[int], dict[str, Callable[[], torch.Tensor]]] | None
                 ) -> Iterator[None]:
    """Inside the block, a decoder layer whose quantized weights the run dropped (stages.releaser) has them made
    from its kept codes (`made(i)`: {linear: a function making its weight}, the exact values it computed with)
    while it runs, and dropped again after: one layer's weights alive at a time. Nothing when `made` is None."""
    if made is None:
        yield
        return
    handles = []
    for i, layer in enumerate(layers):
        dropped: list[str] = []

        def make(module: nn.Module, args: Any, i: int = i, dropped: list[str] = dropped) -> None:
            for name, fn in made(i).items():
                weight = get_module(module, name).weight
                if not weight.numel():
                    weight.data = fn()
                    dropped.append(name)

        def drop(module: nn.Module, args: Any, output: Any, dropped: list[str] = dropped) -> None:
            release_weights(module, dropped)
            dropped.clear()

        handles += [layer.register_forward_pre_hook(make), layer.register_forward_hook(drop)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def as_stored(module: nn.Module, dtype: torch.dtype, keep: Iterable[str] = ()) -> None:
    """In place: every float parameter and persistent buffer of `module` rounded to `dtype` (what a
    checkpoint in `dtype` holds) and held in float32, except the tensors named in `keep` (held in float32
    as they are). Computed buffers (rotary frequencies) are left alone: a checkpoint does not hold them."""
    keep = set(keep)
    skip = {id(t) for n, t in module.named_parameters(remove_duplicate=False) if n in keep}
    for owner in module.modules():
        skip.update(id(b) for n, b in owner._buffers.items() if b is not None and n in owner._non_persistent_buffers_set)
    module._apply(lambda t: t if id(t) in skip or not t.is_floating_point()  # _apply: INT8 modules repack
                  else t.to(dtype).float() if dtype != torch.float32 else t.float())


def stored_dtype(out: Path) -> torch.dtype:
    """The float dtype of the checkpoint's weights (config.json's `dtype`)."""
    config = json.loads((out / "config.json").read_text())
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(config.get("dtype") or config.get("torch_dtype")), torch.float32)


def compare(reference: torch.Tensor, got: torch.Tensor, stored: torch.dtype, loaded: str,
            unrounded: torch.Tensor | None = None, seconds: float = 0.0) -> dict[str, Any]:
    """The verification record; raises GeminiError when OUT's logits differ beyond the tolerance.
    reference: the in-process logits as stored (n, T, vocab); unrounded: before rounding, for the record
    (None for a streamed run, whose layers are carried as stored only)."""
    if got.shape != reference.shape:
        raise GeminiError(f"verification failed: the written checkpoint gives logits of shape {list(got.shape)}, "
                          f"the in-process model {list(reference.shape)}; the output was not kept")
    finite = torch.isfinite(reference)  # all of them, unless a broken input was let through (allow_nonfinite)
    if bool(torch.isfinite(got[~finite]).any()):
        raise GeminiError("verification failed: the written checkpoint gives finite logits where the in-process "
                          "model's are not; the output was not kept. This is a bug: please report it")
    windows = list(reference.shape[:2])
    rounding = _g(float((unrounded - reference)[finite].abs().max())) if unrounded is not None else None
    reference, got = reference[finite], got[finite]
    diff = float((got - reference).abs().max()) if reference.numel() else 0.0
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    bound = TOLERANCE * scale
    record = {"windows": windows, "max_abs_logit_diff": _g(diff), "max_abs_logit": _g(scale),
              "tolerance": _g(bound), "dtype": str(stored).removeprefix("torch."),
              "storage_rounding_diff": rounding, "loaded": loaded, "seconds": round(seconds, 3),
              **({"nonfinite_logits": int((~finite).sum())} if not bool(finite.all()) else {})}
    if not diff <= bound:  # also catches NaN
        raise GeminiError(f"verification failed: the written checkpoint's logits differ from the in-process "
                          f"model's by up to {diff:.4g} (allowed {bound:.3g}: {TOLERANCE:g} of the largest logit, "
                          f"{scale:.4g}); the output was not kept. This is a bug in a format writer or loader: "
                          "please report it (--no-verify skips the check)")
    return record


def _g(x: float) -> float:
    return float(f"{x:.6g}")


@contextmanager
def _linears_made_on_call(layer: nn.Module, out_dtype: torch.dtype, exact: dict[str, Callable[[], torch.Tensor]]
                          ) -> Iterator[list[str]]:
    """Inside the block, each plain `nn.Linear` of `layer` holds an empty float32 placeholder for each of its
    parameters (so that converting the layer leaves them alone), and gets them as stored just before it runs:
    float32 of the value rounded to `out_dtype`, or `exact[name]()` for its weight; after it runs, the
    placeholder again. Its own tensors are back after the block, or, in a layer held in float32 (which the probe
    has always rounded in place, as `as_stored`), the values it ran with: rounded, or made (a dropped weight
    stays dropped). Yields the parameters handled ("q_proj.weight")."""
    linears = {n: m for n, m in layer.named_modules() if type(m) is nn.Linear}
    in_place = all(p.dtype == torch.float32 for p in layer.parameters())
    own = {n: dict(m.named_parameters(recurse=False)) for n, m in linears.items()}
    kept = {n: {k: p.data for k, p in params.items()} for n, params in own.items()}

    def empty(params: dict[str, nn.Parameter]) -> None:
        for p in params.values():
            p.data = torch.empty(0, dtype=torch.float32, device=p.device)

    def made(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for k, p in own[name].items():
                value = kept[name][k]
                p.data = exact[name]() if k == "weight" and name in exact else value.to(out_dtype).float()
                if in_place and value.numel():
                    kept[name][k] = p.data
        return hook

    handles = []
    try:
        for name, module in linears.items():
            empty(own[name])
            handles += [module.register_forward_pre_hook(made(name)),
                        module.register_forward_hook(lambda m, a, o, name=name: empty(own[name]))]
        yield [f"{n}.{k}" for n, params in own.items() for k in params]
    finally:
        for handle in handles:
            handle.remove()
        for name, params in own.items():
            for k, p in params.items():
                p.data = kept[name][k]


class Probe:
    """The probe windows carried through the run's finished layers as they are written, then checked
    against OUT (the one check, for a model in memory and for a streamed run alike).

    Layer 0's inputs are captured from the source's embeddings as stored (a model in memory has them rounded
    in place: it writes the same values); each finished layer, in the state it is written in, runs the probe
    (`advance`, called by the shard sink before the layer is written); then the final norm and head, as
    written. `unrounded`: the in-process logits before any rounding, for the record (a model in memory only).
    Memory: the probe's (2, 64, hidden) activations."""

    def __init__(self, source: Any, tokenizer: Any, out_dtype: torch.dtype, device: torch.device,
                 unrounded: bool = False, made: Callable[[int], dict[str, Callable[[], torch.Tensor]]] | None = None
                 ) -> None:
        self.source, self.out_dtype, self.device = source, out_dtype, device
        model = source.model
        self.windows = probe_windows(tokenizer, model.config.vocab_size)
        if unrounded:
            with weights_made(source.layers, made):
                self.unrounded = model_logits(model, self.windows)
        else:
            self.unrounded = None
        self.lazy = getattr(source, "ckpt", None) is not None
        if not self.lazy:  # a model in memory: its embeddings rounded in place, as OUT holds them
            as_stored(model.get_input_embeddings(), out_dtype)
        self.hidden = embed(source, self.windows, device=device, stored=out_dtype)  # (n, T, d) float32
        self.resumed: list[int] = []

    @torch.no_grad()
    def advance(self, i: int, layer: nn.Module, exact: dict[str, Callable[[], torch.Tensor]]) -> None:
        """Run the probe through finished layer i as it is stored (with the arguments the model gives layer i):
        floats rounded to the output dtype and computed in float32, the linears `exact` names ({name relative
        to the layer: a function making its weight}) with those weights. A plain linear's float32 weights are
        made just before it runs and dropped after it (`_linears_made_on_call`): one linear's copy alive at a
        time (the whole layer converted at once, as the rest still is, held all of an 8B layer's: +0.87 GB, the
        peak of the streamed runs). The layer keeps its own tensors: a model loaded from a safetensors file holds
        its weights in the file's mapping, whose pages a swapped-out weight does not give back while the rest
        of the model is alive (+13 MB resident a demo layer)."""
        released = [n for n in exact if not get_module(layer, n).weight.numel()]  # dropped by the run (memory.py)
        with _linears_made_on_call(layer, self.out_dtype, exact) as made:
            with computing_in(layer, torch.float32):  # float32 copies of the rest of a lower-precision layer
                as_stored(layer, self.out_dtype, made)
                for name, make in exact.items():
                    if f"{name}.weight" not in made:
                        weight = get_module(layer, name).weight
                        if name in released:
                            weight.data = make()
                        else:
                            weight.data.copy_(make())
                through_layer(layer, self.hidden.tensor, self.hidden.tensor, self.hidden.layer_kwargs[i],
                              device=self.device, dtype=torch.float32, batch=1)  # one window at a time, as the loaded side
        release_weights(layer, released)  # dropped again: one layer's weights made at a time

    def check(self, out: Path, head: HeadModule | None = None, state: Path | None = None, *,
              trust_remote_code: bool = False, progress: Progress | None = None,
              streamed: bool | None = None, input_model: str | None = None,
              allow_nonfinite: bool = False) -> dict[str, Any]:
        """The head over the carried activations (`head(name, module)`: what the run writes for a module
        outside the layers, e.g. an INT8 head made at write time), then OUT loaded back (in memory when it
        fits, else one layer at a time; `streamed` forces either) and compared. On a failure the run's resume
        state (`state`) goes too: its finished layers are what was written wrong, and a rerun resuming from
        them would skip the check.

        Blame where it belongs: when the in-process logits are not finite, the input model (`input_model`,
        the recipe's MODEL) is run on the probe too: if it is not finite either, the input is broken (an
        InputError, exit 2); else the compression broke it (exit 1). With `allow_nonfinite` (the user let a
        broken input through) the logits are compared where they are finite, and must be non-finite in OUT
        where they are not."""
        progress = progress or NullProgress()
        try:
            if self.resumed:  # only where a finished layer could not be rebuilt from disk (sinks.ShardSink)
                return {"windows": list(self.windows.shape), "skipped": f"the run resumed: layers {self.resumed[0]}-"
                        f"{self.resumed[-1]} were finished by an earlier process and their format cannot be read "
                        "back into a layer here"}
            t0 = time.perf_counter()

            def as_written(name: str, module: nn.Module) -> nn.Module:
                if head is not None and name in getattr(head, "names", {name}):
                    module = head(name, module)  # what the run wrote, made from the weights as stored, as the run
                    # made it (walk_outside); not a float32 copy: an INT8 head is quantized a block of rows at a time
                elif type(module) is nn.Linear and module.weight.dtype != torch.float32:  # a head read as stored
                    return module.to(self.out_dtype)  # rounded as written and held so: float32 by rows (forward.py)
                as_stored(module, self.out_dtype)
                return module

            parts = dict(head_logits(self.source, self.hidden, device=self.device, transform=as_written))
            reference = torch.cat([parts[k] for k in sorted(parts)])
            streamed = too_big(out) if streamed is None else streamed
            if not allow_nonfinite and not bool(torch.isfinite(reference).all()):
                if state is not None:
                    shutil.rmtree(state, ignore_errors=True)
                raise self.blame(reference, input_model, trust_remote_code, bool(streamed))
            progress.info(f"verifying {final_name(out)}: loading it back "
                          f"{'one layer at a time' if streamed else 'in memory'}")
            got = loaded_logits(out, self.windows, trust_remote_code, streamed, self.device)
            try:
                return compare(reference, got, stored_dtype(out), "streamed" if streamed else "in-memory",
                               self.unrounded, seconds=time.perf_counter() - t0)
            except GeminiError:
                if state is not None:
                    shutil.rmtree(state, ignore_errors=True)
                raise
        finally:
            self.hidden.close()

    def blame(self, reference: torch.Tensor, input_model: str | None, trust_remote_code: bool,
              streamed: bool) -> GeminiError:
        """The error for in-process logits that are not finite: the input's fault or the run's."""
        bad = int((~torch.isfinite(reference)).sum())
        got = None
        if input_model is not None:
            path = local_dir(input_model)
            got = loaded_logits(Path(path) if streamed and path is not None else Path(input_model), self.windows,
                                trust_remote_code, streamed and path is not None, self.device)
        if got is not None and not bool(torch.isfinite(got).all()):
            return NonFiniteError(f"the input model {input_model} itself gives non-finite logits on the check's probe "
                                  f"tokens ({int((~torch.isfinite(got)).sum()):,} values): it is broken before any "
                                  "compression (weights, or activations that overflow); nothing was written")
        return GeminiError(f"the compressed model gives {bad:,} non-finite logits on the check's probe tokens while the "
                           f"input model does not: the compression broke it; nothing was written (please report it)")


def too_big(out: Path) -> bool:
    """Whether OUT, loaded in float32, would not fit in memory (memory.too_big: the one rule)."""
    return is_readable_dir(out) and over(loaded_bytes(out, torch.float32))


def loaded_logits(out: Path, windows: torch.Tensor, trust_remote_code: bool, streamed: bool,
                  device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """OUT's logits (n, T, vocab) in float32, loaded in float32 by the loader (or read one layer at a time),
    computed on `device` one window at a time like the in-process side: with per-token INT8 activations a
    last-bit difference (a batched matmul) can flip an activation code, which is not what is checked here."""
    if streamed:
        source = LazyLayers(LazyCheckpoint(out, trust_remote_code=trust_remote_code, allow_nonfinite=True), torch.float32)
        hidden = final_hidden(source, windows, device=device, batch=1)
        try:
            return torch.cat([logits for _, logits in head_logits(source, hidden, device=device)])
        finally:
            hidden.close()

    model = load_model(str(out), dtype=torch.float32, trust_remote_code=trust_remote_code, allow_nonfinite=True,
                       tokenizer=False).model.to(device)  # the comparison judges its values
    try:
        return model_logits(model, windows)
    finally:
        del model
        gc.collect()
