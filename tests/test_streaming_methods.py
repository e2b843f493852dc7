"""Streaming of the calibrated methods and the packed/sparse formats: Wanda, SparseGPT, SmoothQuant,
AWQ, AWQ+GPTQ, GPTQ in compressed-tensors, sparse-bitmask outputs. Streamed == in memory tensor by
tensor (bitwise), configs equal; resume of a calibrated prune; a chain of calibrated stages in one pass
per layer. Same tiny sharded bf16 Llama as tests/test_streaming.py (every layer straddles two shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress import layerwise
from geminicompress.compress.compose import OnePassFn, compose
from geminicompress.formats.checkpoint import read_tensors
from geminicompress.recipes.loader import recipe_from_stage
from geminicompress.streaming import ShardSink, run_streamed
from tiny import tiny_model, tiny_tokenizer

runner = CliRunner()
CALIB = ["--samples", "4", "--calib-seq-len", "48"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Llama saved in bf16 in ~60 KB shards, 3 layers."""
    path = tmp_path_factory.mktemp("sharded") / "tiny-bf16"
    tiny_model(num_hidden_layers=3).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    return path


def _same_tensors(a: Path, b: Path, files: tuple[str, ...] = ()) -> None:
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k  # bitwise
    for name in ("config.json", *files):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


def _both(sharded: Path, tmp_path: Path, command: str, *args: str) -> tuple[Path, Path]:
    """OUT of the in-memory run (--dtype bfloat16: the streamed default for a bf16 input) and of the streamed one."""
    mem, st = tmp_path / "mem", tmp_path / "str"
    res = invoke(command, sharded, "-o", mem, "-q", "--no-stream", "--dtype", "bfloat16", *args)
    assert res.exit_code == 0, res.output
    res = invoke(command, sharded, "-o", st, "-q", "--stream", *args)
    assert res.exit_code == 0, res.output
    assert json.loads((st / "report.json").read_text())["export"]["streamed"]
    return mem, st


def _result(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())["stages"][0]["result"]


@pytest.mark.parametrize("args", [
    ["--method", "wanda", "--sparsity", "0.5"],
    ["--method", "sparsegpt", "--sparsity", "0.5"],
    ["--method", "sparsegpt", "--pattern", "2:4", "--format", "compressed-tensors"],  # sparse-24-bitmask
    ["--method", "wanda", "--sparsity", "0.5", "--format", "compressed-tensors"],  # sparse-bitmask
    ["--sparsity", "0.4", "--format", "compressed-tensors"],  # magnitude global, sparse-bitmask
])
def test_streamed_prune_equals_in_memory_bitwise(sharded, tmp_path, args):
    mem, st = _both(sharded, tmp_path, "prune", *args, *CALIB)
    _same_tensors(mem, st)
    rm, rs = _result(mem), _result(st)
    assert rm["layers"] == rs["layers"] and rm["achieved_sparsity"] == rs["achieved_sparsity"]
    if "compressed-tensors" in args:
        assert any(k.endswith(".bitmask") for k in read_tensors(st))


@pytest.mark.parametrize("args", [
    ["--method", "w8a8"],  # SmoothQuant (alpha 0.5, the default): statistic from the float layers' inputs
    ["--method", "awq", "--group-size", "32"],  # AWQ GEMM
    ["--method", "awq", "--group-size", "32", "--format", "compressed-tensors"],
    ["--method", "awq+gptq", "--group-size", "32"],
    ["--method", "gptq", "--group-size", "32", "--format", "compressed-tensors", "--calib-dtype", "float32"],
])
def test_streamed_quantize_equals_in_memory_bitwise(sharded, tmp_path, args):
    mem, st = _both(sharded, tmp_path, "quantize", *args, *CALIB)
    _same_tensors(mem, st)
    rm, rs = _result(mem), _result(st)
    if "w8a8" in args:
        assert rs["smoothquant"] == rm["smoothquant"] and rs["smoothquant"]["folded_groups"] > 0
        assert rm["layers"] == rs["layers"]  # the largest scale and the error of every linear
    else:
        assert rm["layers"] == rs["layers"]  # per layer: the searched alphas and errors, or the GPTQ losses
    if args[1].startswith("awq"):  # the saved search (scales, clips) too
        search_m, search_s = (read_tensors(d / "awq_search") for d in (mem, st))
        assert search_m.keys() == search_s.keys() and all(torch.equal(search_m[k], search_s[k]) for k in search_m)


def test_wanda_resumes_after_a_crash_bitwise(sharded, tmp_path, monkeypatch):
    """Killed at layer 2: layers 0-1 come back from the written shards (Wanda only zeroes bf16 weights, so
    they are exactly what the run computed with) and the result equals an uninterrupted run."""
    recipe = recipe_from_stage(str(sharded), {"type": "prune", "method": "wanda", "sparsity": 0.5,
                                              "format": "compressed-tensors"}, {"samples": 4, "seq_len": 48}, "test")
    run_streamed(recipe, tmp_path / "straight", max_shard_bytes=40_000)
    finish = ShardSink.finish

    def crashing(self, i, layer, summary, kept):
        if i == 2:
            raise RuntimeError("killed")
        return finish(self, i, layer, summary, kept)

    monkeypatch.setattr(ShardSink, "finish", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        run_streamed(recipe, tmp_path / "resumed", max_shard_bytes=40_000)
    monkeypatch.undo()
    seen = []

    def recording(self, i, layer, summary, kept):
        seen.append(i)
        return finish(self, i, layer, summary, kept)

    monkeypatch.setattr(ShardSink, "finish", recording)
    run_streamed(recipe, tmp_path / "resumed", max_shard_bytes=40_000)
    assert seen == [2]  # layers 0 and 1 were read back, not recomputed
    _same_tensors(tmp_path / "straight", tmp_path / "resumed")
