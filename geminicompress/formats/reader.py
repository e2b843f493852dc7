"""One quantized module of a checkpoint at a time: how a format stores a module and what module our
loader puts in its place. Both ways of reading a checkpoint use it, so they compute the same thing:

- `load_with_reader` loads the whole checkpoint into memory (`formats.load`, for gptq, awq, pack-quantized,
  int-quantized and sparse-bitmask alike);
- `models.lazy.LazyCheckpoint` builds one module when its decoder layer is read and drops it after
  (eval and the check of OUT for a model bigger than memory).

A format's `reader(path, config)` returns a `ModuleReader` (e.g. marker `qweight`, `weight_scale`, `bitmask`);
dense checkpoints have no reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn

from geminicompress.core.arch import get_module, set_module
from geminicompress.core.errors import GeminiError


@dataclass(frozen=True)
class ModuleReader:
    marker: str  # "<module>.<marker>" on disk marks a module stored this way
    suffixes: tuple[str, ...]  # every suffix of such a module's tensors (the marker's and optional ones)
    build: Callable[[str, dict[str, torch.Tensor], torch.dtype], nn.Module]  # (name, {suffix: tensor}, float dtype)
    after_load: Callable[[nn.Module], object] | None = None  # run once on a whole loaded model (in memory)

    def modules(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """{module name: the checkpoint keys of its tensors} for every module stored this way."""
        keys = set(keys)
        tail = "." + self.marker
        names = sorted(k[: -len(tail)] for k in keys if k.endswith(tail))
        return {n: [f"{n}.{s}" for s in self.suffixes if f"{n}.{s}" in keys] for n in names}

    def module(self, name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
        """Module `name` built from its checkpoint tensors (keyed by full name)."""
        head = name + "."
        return self.build(name, {k[len(head):]: v for k, v in tensors.items()}, dtype)


def check_replaces(model: nn.Module, name: str, new: nn.Module, where: Path | str) -> None:
    """A module read from the checkpoint must stand in for a linear of the same shape in the architecture."""
    try:
        old = get_module(model, name)
    except AttributeError as exc:
        raise GeminiError(f"{where}: quantized module {name} does not exist in the model's architecture") from exc
    shape = (getattr(new, "out_features", None), getattr(new, "in_features", None))
    if not isinstance(old, nn.Linear) or shape != (old.out_features, old.in_features):
        raise GeminiError(f"{where}: quantized module {name} is stored as {shape[0]}x{shape[1]} but the architecture "
                          f"has {type(old).__name__} {getattr(old, 'out_features', '?')}x{getattr(old, 'in_features', '?')}")


def load_with_reader(path: Path, dtype: torch.dtype, reader: ModuleReader) -> nn.Module:
    """The whole checkpoint at `path` in memory: every module `reader` recognises built by it, everything
    else assigned into the skeleton (parameters on the meta device until then: no float copy of the model
    is ever made), float tensors in the skeleton's dtype."""
    from geminicompress.formats.checkpoint import float_skeleton, read_tensors
    from geminicompress.host.memory import out_of_the_mapping

    tensors = read_tensors(path)
    model = float_skeleton(path, dtype)  # every parameter is assigned (missing ones are an error)
    modules = reader.modules(tensors)
    for name, keys in modules.items():
        new = reader.module(name, {k: tensors.pop(k) for k in keys}, dtype)
        check_replaces(model, name, new, path)
        set_module(model, name, new)
    expected = model.state_dict()
    for key, value in tensors.items():
        if key in expected and expected[key].is_floating_point() and not value.is_floating_point():
            raise GeminiError(f"{path}: {key} is stored as {str(value.dtype).removeprefix('torch.')} where the "
                              "architecture holds a float tensor (are the tensors that quantize it missing?)")
        if key in expected and value.is_floating_point() and value.dtype != expected[key].dtype:
            tensors[key] = value.to(expected[key].dtype)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    del tensors
    missing = [k for k in missing if k.rpartition(".")[0] not in modules and k not in tied_output_keys(model)]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise GeminiError(f"{path}: checkpoint does not match the architecture ({what})")
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise GeminiError(f"{path}: checkpoint does not match the architecture (missing {left[:3]})")
    out_of_the_mapping(model)  # the file's mapping goes: its read pages would stay resident beside the modules
    if reader.after_load is not None:
        reader.after_load(model)
    return model.eval()


def tied_output_keys(model: nn.Module) -> set[str]:
    """The output head's weight name when config.json ties it to the input embeddings (stored once)."""
    if not getattr(model.config, "tie_word_embeddings", False) or model.get_output_embeddings() is None:
        return set()
    names = {m: n for n, m in model.named_modules()}
    return {f"{names[model.get_output_embeddings()]}.weight"}
