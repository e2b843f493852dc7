"""Streaming (models bigger than memory): lazy checkpoint, shard writer, streamed prune/int8 == in memory,
resume after a crash, dtype kept, bad input refused in one line. Tiny models sharded on purpose so that
a decoder layer is split across two shard files."""

from __future__ import annotations

import errno
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_sharded, tiny_model
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.engine.sinks import ShardSink
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats import shards as shards_mod
from geminicompress.formats.bits import unpack_bits
from geminicompress.formats.checkpoint import read_tensors
from geminicompress.formats.shards import DiskFullError, ShardWriter
from geminicompress.models.lazy import LazyCheckpoint, LazyTensors
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

runner = CliRunner()


def _layer_files(path: Path) -> dict[str, set[str]]:
    files: dict[str, set[str]] = defaultdict(set)
    for name, file in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].items():
        if ".layers." in name:
            files[name.split(".")[2]].add(file)
    return files


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k  # bitwise


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def run_streamed(recipe, out: Path, **kwargs) -> dict:
    return run_recipe(recipe, out, RunOptions(stream=True, device=torch.device("cpu"), **kwargs))


# ---- the lazy checkpoint ----
def test_lazy_layers_equal_the_model_and_are_freed(tmp_path):
    path = save_sharded(tmp_path / "m", dtype=torch.float32)
    assert any(len(f) > 1 for f in _layer_files(path).values()), "a layer must straddle two shards"
    model = tiny_model(num_hidden_layers=3)
    ckpt = LazyCheckpoint(path)
    assert ckpt.dtype == torch.float32 and all(p.is_meta for p in ckpt.model.parameters())
    for i in range(3):
        layer = ckpt.materialise(f"model.layers.{i}")
        want = model.model.layers[i].state_dict()
        assert {k: v for k, v in layer.state_dict().items()}.keys() == want.keys()
        assert all(torch.equal(v, want[k]) for k, v in layer.state_dict().items())
        ckpt.release(f"model.layers.{i}")
        assert all(p.is_meta for p in layer.parameters())
    assert ckpt.outside_modules() == ["model.embed_tokens", "model.norm", "lm_head"]
    lazy = LazyTensors(ckpt, ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"])
    assert lazy.total == 128 * 64 + 384 * 64 and torch.equal(lazy[1], model.lm_head.weight)
    # the threshold's strided sample, read through a memory map: the same values as in memory
    up, head = model.model.layers[0].mlp.up_proj.weight, model.lm_head.weight
    assert torch.equal(lazy.sample(7), torch.cat([up.flatten()[::7], head.flatten()[::7]]).float())


def test_lazy_reads_bf16_as_stored_or_cast(sharded):
    ckpt = LazyCheckpoint(sharded)
    assert ckpt.dtype == torch.bfloat16
    assert ckpt.materialise("model.layers.1").self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ckpt.materialise("model.layers.1", torch.float32).self_attn.q_proj.weight.dtype == torch.float32
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.o_proj.weight"]
    lazy = LazyTensors(ckpt, names)
    want = torch.cat([ckpt.read([n])[n].flatten()[::5] for n in names]).float()
    assert torch.equal(lazy.sample(5), want)  # bf16 through the memory map


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_name_the_file_or_tensor(sharded, tmp_path):
    files = sorted(sharded.glob("model-*.safetensors"))
    missing = _copy(sharded, tmp_path / "missing")
    (missing / files[1].name).unlink()
    with pytest.raises(InputError, match=f"names shard {files[1].name}, which does not exist"):
        LazyCheckpoint(missing)

    truncated = _copy(sharded, tmp_path / "truncated")
    with open(truncated / files[2].name, "r+b") as f:
        f.truncate(files[2].stat().st_size - 100)
    with pytest.raises(InputError, match=f"{files[2].name}: cannot be read .* truncated"):
        LazyCheckpoint(truncated)

    absent = _copy(sharded, tmp_path / "absent")
    index = json.loads((absent / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = files[0].name
    (absent / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="tensor model.layers.0.mlp.ghost.weight to .*which does not hold it"):
        LazyCheckpoint(absent)

    shapes = _copy(sharded, tmp_path / "shapes")
    config = json.loads((shapes / "config.json").read_text())
    config["intermediate_size"] = 96
    (shapes / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[128, 64\] but config.json implies \[96, 64\]"):
        LazyCheckpoint(shapes)


def test_cli_bad_input_one_line_out_untouched(sharded, tmp_path):
    broken = _copy(sharded, tmp_path / "broken")
    victim = sorted(broken.glob("model-*.safetensors"))[0]
    victim.unlink()
    res = invoke("prune", broken, "-o", tmp_path / "out", "-q", "--stream")
    assert res.exit_code == 2, res.output
    assert victim.name in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---- the shard writer ----
def _units(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{f"u{i}.a": torch.randn(10, 30, generator=g).to(torch.bfloat16), f"u{i}.b": torch.randint(-9, 9, (50,), generator=g).to(torch.int8),
             f"u{i}.c": torch.randn(7, generator=g)} for i in range(n)]


def test_shard_writer_bounds_shards_and_indexes_them(tmp_path):
    units = _units()
    writer = ShardWriter(tmp_path / "work", max_bytes=1000)
    for i, u in enumerate(units):
        writer.write(f"unit{i}", u, {"i": i})
    out = tmp_path / "out"
    out.mkdir()
    info = writer.finish(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(info["files"]) > 2 and sorted(set(index["weight_map"].values())) == info["files"]
    assert info["files"][0] == f"model-00001-of-{len(info['files']):05d}.safetensors"
    flat = {k: v for u in units for k, v in u.items()}
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in info["files"])
    for f in info["files"]:
        assert (out / f).stat().st_size <= 1000 + 1000  # header + at most max_bytes of data
        for k, v in load_file(str(out / f)).items():
            assert index["weight_map"][k] == f and v.dtype == flat[k].dtype and torch.equal(v, flat[k])
    assert set(index["weight_map"]) == set(flat)


def test_shard_writer_resumes_after_a_crash_mid_unit(tmp_path):
    units = _units()
    writer = ShardWriter(tmp_path / "work", max_bytes=1500)
    writer.write("unit0", units[0])
    writer.write("unit1", units[1])
    data = next((tmp_path / "work").glob("*.data"))
    with open(data, "ab") as f:  # a half-written third unit
        f.write(b"\x01" * 333)
    writer = ShardWriter(tmp_path / "work", max_bytes=1500)
    assert writer.finished("unit1") and not writer.finished("unit2")
    for i in (1, 2, 3):
        writer.write(f"unit{i}", units[i])  # unit1 again: skipped
    (tmp_path / "a").mkdir()
    writer.finish(tmp_path / "a")
    straight = ShardWriter(tmp_path / "work2", max_bytes=1500)
    for i, u in enumerate(units):
        straight.write(f"unit{i}", u)
    (tmp_path / "b").mkdir()
    straight.finish(tmp_path / "b")
    for f in sorted((tmp_path / "b").iterdir()):
        assert f.read_bytes() == (tmp_path / "a" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("max_bytes", [10**6, 600])  # header in its reserved region / too big for it: copied
def test_shard_writer_writes_each_byte_once_and_survives_a_kill_at_close(tmp_path, monkeypatch, max_bytes):
    from safetensors.torch import load_file as load

    if max_bytes == 600:
        monkeypatch.setattr(shards_mod, "header_reserve", lambda max_bytes: 64)  # smaller than any header
    else:
        monkeypatch.setattr(shards_mod, "SMALL_SHARD", 0)  # the header written in place however small the shard
    units = _units()
    flat = {k: v for u in units for k, v in u.items()}
    writer = ShardWriter(tmp_path / "work", max_bytes=max_bytes)
    writer.write("unit0", units[0])
    # killed right after a shard was closed, before progress.json recorded it
    save_state = ShardWriter._save_state
    monkeypatch.setattr(ShardWriter, "_save_state", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        writer._close_open()
    monkeypatch.setattr(ShardWriter, "_save_state", save_state)
    writer = ShardWriter(tmp_path / "work", max_bytes=max_bytes)
    for i, u in enumerate(units):
        writer.write(f"unit{i}", u)
    (tmp_path / "out").mkdir()
    info = writer.finish(tmp_path / "out")
    got = {k: v for f in info["files"] for k, v in load(str(tmp_path / "out" / f)).items()}
    assert set(got) == set(flat) and all(torch.equal(got[k], flat[k]) for k in flat)
    if max_bytes == 10**6:  # one shard: the reserved header region, then the data, nothing copied
        data = sum(v.numel() * v.element_size() for v in flat.values())
        assert info["files"] == ["model.safetensors"]
        assert (tmp_path / "out" / "model.safetensors").stat().st_size == shards_mod.header_reserve(10**6) + data


def test_a_small_shard_is_written_without_padding(tmp_path):
    """A shard whose data is small next to the header reserve is rewritten with its exact header: a small
    model's checkpoint is as big as its tensors (header + data), not padded by the reserve."""
    import struct

    flat = {k: v for u in _units() for k, v in u.items()}
    writer = ShardWriter(tmp_path / "work")  # 2 GB shards: a 1 MB reserve
    writer.write("unit0", flat)
    (tmp_path / "out").mkdir()
    writer.finish(tmp_path / "out")
    raw = (tmp_path / "out" / "model.safetensors").read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    data = sum(v.numel() * v.element_size() for v in flat.values())
    assert len(raw) == 8 + header + data and header < 2048


def test_shard_writer_disk_full_is_one_line_and_resumable(tmp_path, monkeypatch):
    units = _units()
    writer = ShardWriter(tmp_path / "work", max_bytes=10**6)
    writer.write("unit0", units[0])

    def full(t):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards_mod, "_bytes", full)
    with pytest.raises(DiskFullError, match=r"disk full while writing .*part-00001.data .*resumes after the 1 finished"):
        writer.write("unit1", units[1])
    monkeypatch.undo()
    writer = ShardWriter(tmp_path / "work", max_bytes=10**6)
    assert writer.finished("unit0") and not writer.finished("unit1")


# ---- streamed == in memory ----
@pytest.mark.parametrize("args", [
    ["prune", "--sparsity", "0.4"],  # global magnitude: exact threshold from the streaming pass
    ["prune", "--sparsity", "0.3", "--scope", "layer"],
    ["prune", "--pattern", "2:4"],
    ["quantize", "--method", "int8"],
    ["quantize", "--method", "w8a8", "--smoothquant-alpha", "0"],  # without SmoothQuant (with: test_streaming_methods.py)
])
def test_streamed_equals_in_memory_bitwise(sharded, tmp_path, args):
    res = invoke(*args[:1], sharded, "-o", tmp_path / "mem", "-q", "--no-stream", "--dtype", "bfloat16", *args[1:])
    assert res.exit_code == 0, res.output
    res = invoke(*args[:1], sharded, "-o", tmp_path / "str", "-q", "--stream", *args[1:])  # dtype: the input's
    assert res.exit_code == 0, res.output
    _same_tensors(tmp_path / "mem", tmp_path / "str")
    mem, st = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("mem", "str"))
    assert mem == st and st["dtype"] == "bfloat16"
    rm, rs = (json.loads((tmp_path / d / "report.json").read_text())["stages"][0]["result"] for d in ("mem", "str"))
    assert rm["layers"] == rs["layers"]


@pytest.mark.parametrize("calib", [
    [],  # a bf16 checkpoint streams in bfloat16 (layers and activations), as in memory with --calib-dtype bfloat16
    ["--calib-dtype", "float32"],  # float32 layers and activations, as in memory by default
])
def test_streamed_gptq_equals_in_memory_bitwise(sharded, tmp_path, calib):
    args = ["--method", "gptq", "--group-size", "32", "--samples", "4", "--calib-seq-len", "48"]
    res = invoke("quantize", sharded, "-o", tmp_path / "mem", "-q", "--no-stream", "--dtype", "bfloat16", *args,
                 *(calib or ["--calib-dtype", "bfloat16"]))
    assert res.exit_code == 0, res.output
    res = invoke("quantize", sharded, "-o", tmp_path / "str", "-q", "--stream", *args, *calib)
    assert res.exit_code == 0, res.output
    _same_tensors(tmp_path / "mem", tmp_path / "str")
    for name in ("config.json", "quantize_config.json"):
        assert json.loads((tmp_path / "mem" / name).read_text()) == json.loads((tmp_path / "str" / name).read_text())
    rm, rs = (json.loads((tmp_path / d / "report.json").read_text())["stages"][0]["result"] for d in ("mem", "str"))
    assert [r["err"] for r in rm["layers"]] == [r["err"] for r in rs["layers"]]


def test_streamed_output_loads_in_transformers_and_keeps_float32(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_sharded(tmp_path / "f32", dtype=torch.float32)
    res = invoke("prune", path, "-o", tmp_path / "out", "-q", "--stream", "--sparsity", "0.5")
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.float32
    w = torch.cat([model.get_parameter(n).flatten() for n, _ in model.named_parameters() if "proj" in n])
    assert abs(float((w == 0).float().mean()) - 0.5) < 1e-6


def _recipe(path: Path, stage: dict):
    return recipe_from_stage(str(path), stage, {}, "test")


def test_multishard_output_index_and_resume_after_crash(sharded, tmp_path, crash_and_resume):
    recipe = _recipe(sharded, {"type": "prune", "sparsity": 0.4})
    straight = run_streamed(recipe, tmp_path / "straight", max_shard_bytes=50_000)
    index = json.loads((tmp_path / "straight" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((tmp_path / "straight" / f).stat().st_size < 50_000 + 4096 for f in files)
    assert set(index["weight_map"]) == set(read_tensors(sharded))  # every tensor, once

    out = tmp_path / "resumed"
    crash_and_resume.kill(lambda: run_streamed(recipe, out, max_shard_bytes=50_000), at=2)
    assert not out.exists() and (tmp_path / ".resumed.partial" / "state").is_dir()  # OUT untouched, state kept
    report, seen = crash_and_resume.resume(lambda: run_streamed(recipe, out, max_shard_bytes=50_000))
    assert seen == [2]  # layers 0 and 1 came from the shards written before the crash
    _same_tensors(tmp_path / "straight", out)
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == sorted(
        p.name for p in (tmp_path / "straight").iterdir() if "safetensors" in p.name)
    assert straight["export"]["files"] == report["export"]["files"]


def test_a_failure_after_the_shards_are_placed_still_resumes(sharded, tmp_path, monkeypatch):
    """The writer's shards are hard-linked into the output, not moved: a failure after that (here while
    saving the tokenizer) keeps a whole resume state, and the rerun recomputes no layer."""
    from geminicompress.formats.writer import LayerWriter

    recipe = _recipe(sharded, {"type": "prune", "sparsity": 0.4})
    run_streamed(recipe, tmp_path / "straight", max_shard_bytes=50_000)
    save = LayerWriter.write_config

    def failing(*args, **kwargs):
        raise RuntimeError("late failure")

    monkeypatch.setattr(LayerWriter, "write_config", failing)  # config.json is written after the shards are placed
    out = tmp_path / "late"
    with pytest.raises(RuntimeError, match="late failure"):
        run_streamed(recipe, out, max_shard_bytes=50_000)
    assert not out.exists()
    monkeypatch.setattr(LayerWriter, "write_config", save)
    seen = []
    finish = ShardSink.finish
    monkeypatch.setattr(ShardSink, "finish", lambda self, i, *a: seen.append(i) or finish(self, i, *a))
    run_streamed(recipe, out, max_shard_bytes=50_000)
    assert seen == []  # every layer came from the state the failed run left
    _same_tensors(tmp_path / "straight", out)
    assert not (out / "state").exists()


def test_multi_stage_recipe_applies_every_stage_per_layer(sharded, tmp_path):
    stages = [{"type": "prune", "scope": "layer", "sparsity": 0.5}, {"type": "quantize", "method": "int8"}]
    recipe = recipe_from_stage(str(sharded), stages[0], {}, "test")
    recipe = recipe.model_copy(update={"stages": recipe.stages + _recipe(sharded, stages[1]).stages})
    run_streamed(recipe, tmp_path / "out")
    t = read_tensors(tmp_path / "out")
    packed, shape = t["model.layers.1.mlp.up_proj.weight_packed"], t["model.layers.1.mlp.up_proj.weight_shape"]
    q = unpack_bits(packed, 8, int(shape[1])) - 128  # int8 W8A16 is pack-quantized 8-bit: codes + 128
    assert q.shape == tuple(shape.tolist()) and abs(float((q == 0).float().mean()) - 0.5) < 0.01


def test_not_streamable_recipe_is_refused_in_one_line(sharded, tmp_path):
    """What needs the whole model in memory says so: measuring a sensitivity table for an allocation."""
    res = invoke("prune", sharded, "-o", tmp_path / "out", "-q", "--stream", "--method", "wanda",
                 "--allocation", "sensitivity")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--stream: stage 0: prune --allocation sensitivity measures its sensitivity table with the model in " \
           "memory" in res.output, res.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(GeminiError, match="gptq mixed precision measures its sensitivity table"):
        run_streamed(_recipe(sharded, {"type": "quantize", "method": "gptq", "allocation": {"target_bits": 3.5}}),
                     tmp_path / "o2")


@pytest.mark.parametrize("args", [
    ["prune", "--method", "wanda", "--allocation", "owl", "--samples", "4", "--calib-seq-len", "48"],
    ["quantize", "--method", "gptq", "--group-size", "32", "--samples", "4", "--calib-seq-len", "48",
     "--calib-dtype", "float32"],
])
def test_whole_model_decisions_stream_as_pre_passes(sharded, tmp_path, args):
    """OWL's outlier pass walks the checkpoint layer by layer; GPTQ overrides (mixed precision) are per-layer
    specs: both stream and equal the run in memory (bfloat16 output) bitwise."""
    extra = []
    if args[0] == "quantize":
        override = tmp_path / "r.yaml"
        override.write_text(json.dumps({"model": str(sharded), "calibration": {"samples": 4, "seq_len": 48},
                                        "output": {"dtype": "bfloat16"}, "stages": [
            {"type": "quantize", "method": "gptq", "group_size": 32, "calib_dtype": "float32",
             "overrides": {"model.layers.1.mlp.down_proj": "b8g32"}}]}))
        for mode, out in (("--stream", "str"), ("--no-stream", "mem")):
            res = invoke("run", override, "-o", tmp_path / out, "-q", mode)
            assert res.exit_code == 0, res.output
        dynamic = json.loads((tmp_path / "str" / "quantize_config.json").read_text())["dynamic"]
        assert dynamic["+:^model\\.layers\\.1\\.mlp\\.down_proj$"]["bits"] == 8
    else:
        res = invoke(*args[:1], sharded, "-o", tmp_path / "str", "-q", "--stream", *args[1:], *extra)
        assert res.exit_code == 0, res.output
        res = invoke(*args[:1], sharded, "-o", tmp_path / "mem", "-q", "--no-stream", "--dtype", "bfloat16", *args[1:])
        assert res.exit_code == 0, res.output
    _same_tensors(tmp_path / "mem", tmp_path / "str")


def test_gptq_resumes_through_finished_layers_bitwise(sharded, tmp_path, crash_and_resume):
    """A calibrated run killed at layer 2 resumes: layers 0-1 are read back from the written shards
    (GPTQ codes dequantized) to compute layer 2's inputs, and the result equals an uninterrupted run."""
    stage = {"type": "quantize", "method": "gptq", "group_size": 32}
    recipe = recipe_from_stage(str(sharded), stage, {"samples": 4, "seq_len": 48}, "test")
    run_streamed(recipe, tmp_path / "straight", max_shard_bytes=40_000)
    crash_and_resume.kill(lambda: run_streamed(recipe, tmp_path / "resumed", max_shard_bytes=40_000), at=2)
    report = run_streamed(recipe, tmp_path / "resumed", max_shard_bytes=40_000)
    assert [bool(r.get("resumed")) for r in report["stages"][0]["result"]["layers"]] == [True, True, False]
    _same_tensors(tmp_path / "straight", tmp_path / "resumed")


def test_streamed_gptq_resolves_the_auto_group_size_like_in_memory(sharded, tmp_path):
    args = ["--method", "gptq", "--samples", "4", "--calib-seq-len", "48"]  # group size: the default "auto"
    res = invoke("quantize", sharded, "-o", tmp_path / "str", "-q", "--stream", *args)
    assert res.exit_code == 0, res.output
    res = invoke("quantize", sharded, "-o", tmp_path / "mem", "-q", "--no-stream", "--dtype", "bfloat16",
                 "--calib-dtype", "bfloat16", *args)
    assert res.exit_code == 0, res.output
    group = [json.loads((tmp_path / d / "quantize_config.json").read_text())["group_size"] for d in ("str", "mem")]
    assert group[0] == group[1] and group[0] in (32, 64, 128)
