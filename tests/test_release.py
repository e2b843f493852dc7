"""Dropping a finished layer's quantized float weights (memory.release_weights, stages.releaser): the memory
comes back, even from a file's private mapping, and an in-memory run that drops them writes the same bytes and
the same check as one that keeps them (a caller's model, which the run must leave as the stages made it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from tiny import save_sharded

from geminicompress.host.memory import release_weights
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
MB = 1 << 20


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(np, "memmap") or not __import__("sys").platform.startswith("linux"),
                    reason="/proc/self/statm and madvise are Linux's")
def test_a_weight_written_in_a_private_file_mapping_gives_its_pages_back(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * (64 * MB))
    array = np.memmap(path, dtype=np.float32, mode="c", shape=(4096, 4096))  # MAP_PRIVATE, as safetensors maps
    module = nn.Module()
    module.lin = nn.Linear(4096, 4096, bias=False)
    module.lin.weight.data = torch.from_numpy(array)
    module.lin.weight.data.add_(1.0)  # written in place: 64 MB of private copies of the file's pages
    before = _rss()
    dropped = release_weights(module, ["lin"])
    after = _rss()
    assert dropped == 64 * MB
    assert module.lin.weight.numel() == 0 and module.lin.weight.dtype == torch.float32
    assert before - after >= 63 * MB  # every whole page of it (the mapping itself stays, held by numpy)
    assert float(np.asarray(array[0, :4]).sum()) == 0.0  # the file's bytes are what a read sees again


def test_release_weights_skips_what_is_already_dropped():
    module = nn.Module()
    module.lin = nn.Linear(8, 8)
    assert release_weights(module, ["lin"]) == 8 * 8 * 4
    assert release_weights(module, ["lin"]) == 0
    assert module.lin.bias.numel() == 8  # only weights go


@pytest.mark.parametrize("stage", [
    {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16},
    pytest.param({"type": "quantize", "method": "awq", "bits": 4, "group_size": 16}, marks=pytest.mark.slow),
], ids=["gptq", "awq"])
def test_a_run_that_drops_finished_weights_writes_what_one_that_keeps_them_writes(tmp_path, text_file, stage,
                                                                                  monkeypatch):
    import geminicompress.runtime.stages as stages

    dropped: list[int] = []
    monkeypatch.setattr(stages, "release_weights", lambda m, names: dropped.append(release_weights(m, names)))
    src = save_sharded(tmp_path / "src", dtype=torch.float32)
    recipe = recipe_from_stage(str(src), stage, {"data": str(text_file), "samples": 4, "seq_len": 64}, "test")
    owned = run_recipe(recipe, tmp_path / "owned", RunOptions(device=CPU, stream=False))  # loads the model itself: drops as it goes
    linears = sum(m.weight.numel() * 4 for n, m in load_model(str(src), trust_remote_code=False, allow_pickle=False,
                  allow_nonfinite=False).model.model.layers.named_modules() if isinstance(m, nn.Linear))
    assert sum(dropped) == linears  # every quantized linear of every layer, as its layer finished
    dropped.clear()
    loaded = load_model(str(src), trust_remote_code=False, allow_pickle=False, allow_nonfinite=False)
    kept = run_recipe(recipe, tmp_path / "kept", RunOptions(device=CPU, stream=False), loaded=loaded)  # a caller's model: nothing dropped
    a, b = _tensors(tmp_path / "owned"), _tensors(tmp_path / "kept")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    va, vb = owned["export"]["verified"], kept["export"]["verified"]
    assert {k: v for k, v in va.items() if k != "seconds"} == {k: v for k, v in vb.items() if k != "seconds"}
    assert sum(dropped) == 0
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() > 0  # the caller's model keeps its weights


def test_a_checkpoint_file_is_read_into_memory_of_its_own_exactly(tmp_path):
    from safetensors.torch import save_file

    from geminicompress.formats.checkpoint import read_file
    from geminicompress.host.memory import _file_mappings

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
               "c": torch.randint(0, 255, (4, 4), generator=g).to(torch.uint8), "d": torch.tensor(3, dtype=torch.int64),
               "e": torch.randn(2, 3, generator=g).half(), "f": torch.zeros(0, 4), "m": torch.rand(6, generator=g) > 0.5}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    read = read_file(tmp_path / "x.safetensors")
    assert read.keys() == tensors.keys()
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and read[k].shape == v.shape and torch.equal(read[k], v)
    spans = _file_mappings()
    assert not any(lo <= t.data_ptr() < hi for t in read.values() if t.numel() for lo, hi in spans)  # not mapped
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(Exception, match="cut short"):
        read_file(tmp_path / "cut.safetensors")
