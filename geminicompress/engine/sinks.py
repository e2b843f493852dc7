"""Where finished layers go (the walk's *sinks*), and the run's one resume mechanism: a `ShardWriter`
(formats/shards.py) whose finished units are the resume state.

- `ResidentSink`: the layer stays in the model in memory. With a writer, each finished layer's exact
  state (its state dict and the tensors the method kept) is also a unit of a `ShardWriter` in the stage's
  state folder, so a killed run restores it and continues after it.
- `ShardSink`: the layer is written into OUT's shards in the run's format (a `LayerWriter`, formats/) and
  dropped; the written shards are the resume state. A probe (verify.py) may run through each finished
  layer first; what the stages must hold until their summaries (`retain`: AWQ's search results) goes into
  a second writer so that a resumed run has it too.
Both also take the modules outside the decoder layers (`outside`): the resident sink puts a module a stage
replaced (an INT8 head) into the model, the shard sink writes each one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from geminicompress.core.arch import set_module
from geminicompress.core.errors import GeminiError
from geminicompress.formats.shards import ShardWriter

KeptOf = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # (layer, walk's kept) -> the writer's


class ResidentSink:
    """Finished layers stay in the model; with `writer`, each is also saved there for resuming. `release(i, layer,
    kept)`: called on each finished layer last (the weights that the kept codes make again are dropped)."""

    restores_weights = True

    def __init__(self, model: nn.Module, writer: ShardWriter | None = None,
                 release: Callable[[int, nn.Module, dict], None] | None = None) -> None:
        self.model, self.writer, self.release = model, writer, release

    def finished(self, i: int) -> bool:
        return self.writer is not None and self.writer.finished(f"layer.{i}")

    @torch.no_grad()
    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The finished layer's summary and kept tensors, its state put back into `layer`; None when the saved
        state does not fit the layer as read (a stage that replaces modules, e.g. int8/w8a8's INT8 linears with
        their `weight_scale`): the walk then computes the layer again, which gives the same result (the
        stages are deterministic) and leaves the saved unit as it is."""
        unit = f"layer.{i}"
        saved = self.writer.read(unit)  # "<i>.state.<name>", "<i>.kept.<name>": names unique in the writer
        state, kept = f"{i}.state.", f"{i}.kept."
        if layer is not None:
            values = {k[len(state):]: v for k, v in saved.items() if k.startswith(state)}
            if set(values) != set(layer.state_dict()):
                return None
            device = next(layer.parameters()).device
            layer.load_state_dict(values)
            layer.to(device)
        return self.writer.summary(unit), {k[len(kept):]: v for k, v in saved.items() if k.startswith(kept)}

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.writer is not None:
            flat = {f"{i}.state.{k}": v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
            flat.update({f"{i}.kept.{k}": v.detach().cpu().contiguous() for k, v in kept.items()})
            self.writer.write(f"layer.{i}", flat, summary)
        if self.release is not None:
            self.release(i, layer, kept)
        return kept

    def outside_done(self, name: str) -> list[dict] | None:
        return None

    def outside(self, name: str, module: nn.Module, rows: list[dict]) -> None:
        """A module outside the layers after the stages: a replaced one goes into the model."""
        if module is not self.model.get_submodule(name):
            set_module(self.model, name, module)


@dataclass(frozen=True)
class Resume:
    """What a streamed `ShardSink` holds so that a resumed run goes on through its finished layers.
    `load_back(i, layer, tensors)` puts what was written back into a layer, for a resumed calibrated run that
    computes the next layer's inputs through it (None: such a run cannot resume). `retain(kept)`: the kept
    tensors to hold until the summaries, saved in `kept_writer`. `inputs`: the exact inputs of each layer,
    kept when the written layers do not give them back exactly. `rebuild`: how the probe rebuilds a finished
    layer from what was written (None: it cannot)."""

    load_back: Callable[[int, nn.Module, dict[str, torch.Tensor]], None] | None = None
    retain: Callable[[dict], dict] | None = None
    kept_writer: ShardWriter | None = None
    inputs: InputsKeeper | None = None
    rebuild: Callable[[int, nn.Module, dict], None] | None = None


class ShardSink:
    """Finished layers go into OUT's shards as `layer_writer.layer_tensors(i, layer, kept_of(i, kept))` and
    leave memory. `probe`: run through each finished layer, as it is stored, before it is written
    (verify.Probe). `computed`: the layers were computed before this walk (in memory): a finished layer's
    probe goes through the layer as computed. `resume`: what a streamed run keeps for resuming (`Resume`)."""

    restores_weights = False

    def __init__(self, writer: ShardWriter, layer_writer: Any, kept_of: KeptOf, probe: Any = None,
                 computed: bool = False, resume: Resume = Resume()) -> None:
        self.writer, self.layer_writer, self.kept_of, self.probe, self.computed = (
            writer, layer_writer, kept_of, probe, computed)
        self.load_back, self.retain, self.kept_writer = resume.load_back, resume.retain, resume.kept_writer
        self.inputs, self.rebuild = resume.inputs, resume.rebuild

    def finished(self, i: int) -> bool:
        return self.writer.finished(f"layer.{i}")

    def restore(self, i: int, layer: nn.Module | None) -> tuple[dict, dict[str, torch.Tensor]]:
        unit = f"layer.{i}"
        written = None
        if layer is not None:
            if self.load_back is None:
                raise GeminiError("this streamed run cannot resume through a finished layer; rerun with --force")
            written = self.writer.read(unit)
            self.load_back(i, layer, written)
        kept = self.kept_writer.read(unit) if self.kept_writer is not None and self.kept_writer.finished(unit) else {}
        kept = {k.partition(".")[2]: v for k, v in kept.items()}
        if self.probe is not None:
            self._probe_finished(i, layer if self.load_back is self.rebuild else None, written, kept)
        return self.writer.summary(unit), kept

    def _probe_finished(self, i: int, layer: nn.Module | None, written: dict | None, kept: dict) -> None:
        """The probe through layer i, which an earlier process finished, so that a resumed run is verified like
        any other (issue #34): in memory, the layer as the run computed it (the model holds it) with the codes
        the stage kept, as `finish` would; streamed, the layer rebuilt from what was written (`rebuild`: the
        writer's load_back), its quantized linears held exactly as dequantized. A layer that cannot be rebuilt
        from disk (an int8 stage, which writes modules a float layer does not have) is recorded as not
        re-checked (Probe.resumed)."""
        source = self.probe.source
        if self.computed:
            self.probe.advance(i, source.load(i), self.layer_writer.exact_weights(i, self.kept_of(i, kept)))
            return
        if self.rebuild is None:
            self.probe.resumed.append(i)
            return
        import copy

        own = layer is None
        layer = source.load(i) if own else copy.deepcopy(layer)  # the walk goes on with the caller's layer
        try:
            layer.float()  # float32, so that the dequantized weights put back stay exact
            self.rebuild(i, layer, written if written is not None else self.writer.read(f"layer.{i}"))
            self.probe.advance(i, layer, self.layer_writer.as_written_exact(i, layer))
        finally:
            if own:
                source.release(i)

    def finish(self, i: int, layer: nn.Module, summary: dict, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = self.kept_of(i, kept)
        if self.probe is not None:
            # the probe first: rounding a float32 layer to the output dtype in place changes nothing it writes
            # (the writer casts to that dtype; packed linears are written from the kept codes)
            self.probe.advance(i, layer, self.layer_writer.exact_weights(i, mine))
        retained = self.retain(kept) if self.retain is not None else {}
        if self.kept_writer is not None and retained:  # before the layer: a layer written is a layer finished
            self.kept_writer.write(f"layer.{i}", {f"{i}.{k}": v.contiguous() for k, v in retained.items()})
        self.writer.write(f"layer.{i}", self.layer_writer.layer_tensors(i, layer, mine), summary)
        return retained

    def keep_inputs(self, k: int, inputs: Any) -> None:
        if self.inputs is not None:
            self.inputs.keep(k, inputs.batches or [h for h in inputs.hidden])

    def kept_inputs(self, k: int) -> list[torch.Tensor] | None:
        return self.inputs.get(k) if self.inputs is not None else None

    def outside_done(self, name: str) -> list[dict] | None:
        unit = f"outside.{name}"
        return self.writer.summary(unit).get("rows", []) if self.writer.finished(unit) else None

    def outside(self, name: str, module: nn.Module, rows: list[dict]) -> None:
        self.writer.write(f"outside.{name}", self.layer_writer.outside_tensors(name, module), {"rows": rows})


class InputsKeeper:
    """The exact inputs of the layer a streamed run works on, kept with the resume state: for a run whose
    written layers do not give them back exactly (a float weight the stage changed, written in a lower dtype
    than it was computed in: SparseGPT's updates, AWQ's folded scales), so that a killed run resumes with the
    inputs the uninterrupted run used and writes the same bytes. Two slots, by the layer's parity: the inputs
    of layer k+1 are written (atomically) before layer k is recorded as finished, so the first unfinished
    layer's inputs are always on disk. Size: two layers' activations, (n, T, hidden) each."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, k: int) -> Path:
        return self.folder / f"inputs-{k % 2}.safetensors"

    def keep(self, k: int, batches: list[torch.Tensor]) -> None:
        path = self._path(k)
        tmp = path.with_name(path.name + ".tmp")
        save_file({f"b{j}": b.detach().cpu().contiguous() for j, b in enumerate(batches)}, str(tmp),
                  metadata={"layer": str(k), "batches": str(len(batches))})
        os.replace(tmp, path)

    def get(self, k: int) -> list[torch.Tensor] | None:
        path = self._path(k)
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("layer") != str(k):
                return None
            return [f.get_tensor(f"b{j}") for j in range(int(meta["batches"]))]
