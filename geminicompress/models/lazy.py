"""A checkpoint read one decoder layer at a time, so memory follows one layer, not the model's depth.

`LazyCheckpoint(path)` builds the model's skeleton with its parameters on the meta device (accelerate's
`init_empty_weights`; buffers such as the rotary frequencies are small and computed for real), reads
the safetensors headers (single file or sharded with `model.safetensors.index.json`) and checks them
against the skeleton before any work: every shard present and whole, every tensor the index names
present in its shard, every parameter's shape the one config.json implies. `materialise(prefix)` then
reads one module's tensors from the memory-mapped files (each file opened only while it is read, so its
mapped pages leave resident memory again) and `release(prefix)` puts them back on the meta device.

A checkpoint in a format this project writes (GPTQ, AWQ, compressed-tensors int-quantized,
pack-quantized, sparse-bitmask) is read the same way: each quantized module is built, when its layer is
read, by the format's own `ModuleReader` (formats/reader.py), the one its in-memory `load` uses (a
`DequantLinear`, an INT8 module, a decompressed linear), and swapped back for the skeleton's meta linear
on release. So a layer computes exactly what the same layer of the model loaded in memory computes.

`LazyLayers` is the layer *source* of the engine's walk (engine/walk.py) for such a checkpoint; `ModelLayers`
(walk.py) is the one for a model already in memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from geminicompress import formats
from geminicompress.core.arch import Arch, arch_for, get_module, outside_modules, set_module
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats.reader import check_replaces, tied_output_keys
from geminicompress.models.finite import check
from geminicompress.models.headers import open_file, read_headers, safetensors_config


def skeleton(path: Path, trust_remote_code: bool) -> nn.Module:
    """The model config.json in `path` describes, its parameters on the meta device (no weight read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):  # the float architecture: quantized modules are swapped in per read
        del config.quantization_config
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary) real and small
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _renamed_keys(model: nn.Module, stored: dict) -> dict[str, str]:
    """{name in the model: name stored} for the checkpoint keys transformers renames when it loads this class
    (its conversion mapping's plain renamings: GPT-NeoX stores its head as `embed_out`, the model calls it
    `lm_head`)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # an older transformers: names are stored as the model uses them
        return {}
    renamings = [r for r in get_model_conversion_mapping(model) if type(r) is WeightRenaming]
    names = set(model.state_dict(keep_vars=True))
    out: dict[str, str] = {}
    for key in stored:
        new = key
        for r in renamings:
            new = r.rename_source_key(new)[0]
        if new != key and new in names and new not in stored:
            out[new] = key
    return out


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


class LazyCheckpoint:
    """A safetensors checkpoint (dense or quantized) whose weights stay on disk until a module asks for them."""

    def __init__(self, path: Path | str, trust_remote_code: bool = False, allow_nonfinite: bool = False) -> None:
        self.path = Path(path)
        self.allow_nonfinite = allow_nonfinite
        self.nonfinite: list[dict] = []  # what allow_nonfinite let through (models/finite.py)
        self._checked: set[str] = set()
        self.tensors = read_headers(self.path)
        config = safetensors_config(self.path) or {}
        self.format: str | None = formats.detect(config)
        self.reader = formats.module_reader(self.path, config)  # None for a dense checkpoint
        # {module name: its checkpoint keys} for every module stored quantized (read by `reader`)
        self.quantized: dict[str, list[str]] = self.reader.modules(self.tensors) if self.reader else {}
        self._swapped: dict[str, nn.Module] = {}  # quantized module name -> the skeleton's meta module
        self.model = skeleton(self.path, trust_remote_code)
        self.arch: Arch = arch_for(self.model)
        self.layers: nn.ModuleList = get_module(self.model, self.arch.layers)
        self._renamed = _renamed_keys(self.model, self.tensors)
        self._tied = self._tied_names()
        self._check_against_config()

    # ---- what is on disk ----
    @property
    def dtype(self) -> torch.dtype:
        """The float dtype most of the checkpoint's bytes are stored in."""
        by: dict[torch.dtype, int] = defaultdict(int)
        for info in self.tensors.values():
            if info.dtype.is_floating_point:
                by[info.dtype] += info.nbytes
        return max(by, key=by.__getitem__) if by else torch.float32

    def names(self, prefix: str = "") -> list[str]:
        """The parameter/buffer names the skeleton expects under module `prefix`, in model order."""
        module = self.model.get_submodule(prefix) if prefix else self.model
        head = f"{prefix}." if prefix else ""
        return [head + n for n, _ in module.state_dict(keep_vars=True).items()]

    def stored_name(self, name: str) -> str:
        """The tensor `name` reads from: itself, or the input embedding for a tied output head."""
        return self._tied.get(name) or self._renamed.get(name, name)

    def nbytes(self, prefix: str = "", dtype: torch.dtype | None = None) -> int:
        """Bytes of the tensors under `prefix` (each as stored, or in `dtype` when it is floating)."""
        names = [self.stored_name(n) for n in self.names(prefix)]
        names += [k for q in self._quantized_under(prefix) for k in self.quantized[q]]
        infos = [self.tensors[n] for n in names if n in self.tensors]
        return sum(i.numel * (dtype if dtype is not None and i.dtype.is_floating_point else i.dtype).itemsize
                   for i in infos)

    def read(self, names: Sequence[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors `names` (floats cast to `dtype` when given), reading each shard once, in name order."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.tensors[self.stored_name(n)].file].append(n)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            with open_file(file) as f:
                for n in group:
                    try:
                        t = f.get_tensor(self.stored_name(n))
                    except Exception as exc:
                        raise InputError(f"{file}: tensor {n} cannot be read ({str(exc).splitlines()[0]})") from exc
                    if self.stored_name(n) not in self._checked:  # NaN/Inf, the first time it is read
                        check(self.stored_name(n), t, self.allow_nonfinite, self.nonfinite)
                        self._checked.add(self.stored_name(n))
                    out[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return {n: out[n] for n in names}

    # ---- the skeleton ----
    def materialise(self, prefix: str, dtype: torch.dtype | None = None) -> nn.Module:
        """Module `prefix` of the skeleton with its tensors read from disk (floats in `dtype` when given;
        quantized modules built by the format's reader in `dtype`, or in the checkpoint's float dtype)."""
        names = [n for n in self.names(prefix) if self._on_disk(n) and self._owner(n) is None]
        for q in self._quantized_under(prefix):
            self._swap_in(q, dtype or self.dtype)
        module = self.model.get_submodule(prefix)  # after the swap: `prefix` may itself be a quantized module
        head = f"{prefix}." if prefix else ""
        for name, value in self.read(names, dtype).items():
            _set_tensor(module, name[len(head):], value)
        return module

    def _swap_in(self, name: str, dtype: torch.dtype) -> None:
        """Put quantized module `name`, built from its stored tensors by the format's reader, into the skeleton."""
        if name in self._swapped:
            return
        keys = self.quantized[name]
        try:
            new = self.reader.module(name, self.read(keys), dtype)
            check_replaces(self.model, name, new, self.tensors[keys[0]].file)
        except GeminiError as exc:
            raise InputError(str(exc)) from exc
        self._swapped[name] = get_module(self.model, name)
        set_module(self.model, name, new)

    def release(self, prefix: str) -> None:
        """Free module `prefix`: its parameters and persistent buffers (including those of modules a
        method swapped in, e.g. INT8 codes) go back to the meta device; computed buffers (rotary) stay.
        Quantized modules read from the checkpoint give their place back to the skeleton's meta module."""
        for q in self._quantized_under(prefix):
            if q in self._swapped:
                set_module(self.model, q, self._swapped.pop(q))
        module = self.model.get_submodule(prefix)
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None:
                    owner._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                           requires_grad=False)
            for name, b in list(owner._buffers.items()):
                if b is not None and name not in owner._non_persistent_buffers_set:
                    owner._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")

    def layer_prefix(self, i: int) -> str:
        return f"{self.arch.layers}.{i}"

    def outside_modules(self) -> list[str]:
        """The modules holding parameters outside the decoder layers (embeddings, final norm, head)."""
        return outside_modules(self.model)

    @property
    def tied_output(self) -> str | None:
        """The output head's module name when it shares the input embedding's weight (stored once)."""
        return next(iter(self._tied), "").removesuffix(".weight") or None

    def _quantized_under(self, prefix: str) -> list[str]:
        """The quantized modules at or under module `prefix`."""
        head = f"{prefix}." if prefix else ""
        return [q for q in self.quantized if q == prefix or q.startswith(head)]

    def _owner(self, name: str) -> str | None:
        """The quantized module that tensor `name` (a skeleton name) belongs to, if any."""
        owner = name.rpartition(".")[0]
        return owner if owner in self.quantized else None

    def _on_disk(self, name: str) -> bool:
        """Whether `name` is read from the checkpoint (persistent buffers computed at init are not)."""
        return self.stored_name(name) in self.tensors or name not in dict(self.model.named_buffers())

    def _tied_names(self) -> dict[str, str]:
        """{output head weight: input embedding weight} when config.json ties them and the head is not stored."""
        inp = self.model.get_input_embeddings()
        names = {m: n for n, m in self.model.named_modules()}
        return {head: f"{names[inp]}.weight" for head in tied_output_keys(self.model)
                if inp is not None and head not in self.tensors and head not in self._renamed}

    def _check_against_config(self) -> None:
        """Every tensor the skeleton needs is on disk with the shape config.json implies (a quantized
        module's tensors are checked by its reader when its layer is read: only that it exists here)."""
        modules = dict(self.model.named_modules())
        for q in self.quantized:
            if not isinstance(modules.get(q), nn.Linear):
                raise InputError(f"{self.tensors[self.quantized[q][0]].file}: quantized module {q} is not a linear "
                                 "layer of the model's architecture (config.json)")
        expected_names = self.model.state_dict(keep_vars=True)
        known = set(expected_names) | {k for keys in self.quantized.values() for k in keys}
        # the checkpoint's tensors the model does not use: ignored, as transformers' loader ignores them (a warning)
        self.unused = sorted(n for n in self.tensors if n not in known)
        for name, expected in expected_names.items():
            if not self._on_disk(name) or self._owner(name) is not None:
                continue
            info = self.tensors.get(self.stored_name(name))
            if info is None:
                raise InputError(f"{self.path}: tensor {name} is missing from the checkpoint (config.json needs it: does config.json describe these weights?); nothing was written")
            if info.shape != tuple(expected.shape):
                raise InputError(f"{info.file}: tensor {name} has shape {list(info.shape)} but config.json implies "
                                 f"{list(expected.shape)}")


class LazyLayers:
    """Layer source over a `LazyCheckpoint`: layer i read from disk in `dtype`, released after use."""

    def __init__(self, ckpt: LazyCheckpoint, dtype: torch.dtype | None = torch.float32) -> None:
        self.ckpt, self.dtype = ckpt, dtype
        self.model = ckpt.model

    def __len__(self) -> int:
        return len(self.ckpt.layers)

    def load(self, i: int) -> nn.Module:
        return self.ckpt.materialise(self.ckpt.layer_prefix(i), self.dtype)

    def release(self, i: int) -> None:
        self.ckpt.release(self.ckpt.layer_prefix(i))

    def capture_modules(self) -> list[str]:
        """What a forward up to decoder layer 0 needs: the input embeddings."""
        names = {m: n for n, m in self.model.named_modules()}
        return [names[self.model.get_input_embeddings()]]

    def outside_modules(self) -> list[str]:
        return self.ckpt.outside_modules()

    @property
    def tied_output(self) -> str | None:
        return self.ckpt.tied_output

    def load_outside(self, name: str) -> nn.Module:
        """Module `name` (outside the layers) read from disk as stored."""
        return self.ckpt.materialise(name)

    def release_outside(self, name: str) -> None:
        self.ckpt.release(name)

    def tensors(self, names: list[str]) -> "LazyTensors":
        """The named tensors, read from disk one at a time when visited (float32)."""
        return LazyTensors(self.ckpt, names)

    def reading_in(self, dtype: torch.dtype | None) -> "LazyLayers":
        """The same checkpoint's layers read in `dtype` (a pre-pass that must compute as in memory: float32)."""
        return LazyLayers(self.ckpt, dtype)


class LazyTensors(Sequence):
    """A read-only sequence of checkpoint tensors read on access (as float32), for passes such as
    `threshold.kth_smallest` that visit every tensor a few times and keep one at a time."""

    def __init__(self, ckpt: LazyCheckpoint, names: list[str]) -> None:
        self.ckpt, self.names = ckpt, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return LazyTensors(self.ckpt, self.names[i])
        return self.ckpt.read([self.names[i]], torch.float32)[self.names[i]]

    @property
    def total(self) -> int:
        return sum(self.ckpt.tensors[self.ckpt.stored_name(n)].numel for n in self.names)

    def sample(self, step: int) -> torch.Tensor:
        """Every tensor's flat[::step] (as float32, concatenated): the strided sample an in-memory list of
        the same tensors gives, read through a memory map of the file, so only the sampled values are
        touched and nothing else is copied or converted."""
        import numpy as np

        parts = []
        for name in self.names:
            info = self.ckpt.tensors[self.ckpt.stored_name(name)]
            if info.offset < 0:
                parts.append(self[self.names.index(name)].flatten()[::step])
                continue
            width = info.dtype.itemsize
            raw = np.memmap(info.file, dtype=f"<u{width}" if width > 1 else "u1", mode="r", offset=info.offset,
                            shape=(info.numel,))
            picked = torch.from_numpy(np.array(raw[::step]))  # a copy: the map is read-only
            parts.append(picked.view(info.dtype).float())
            del raw
        return torch.cat(parts)
