"""Streaming of the calibrated methods and the packed/sparse formats: Wanda, SparseGPT, SmoothQuant,
AWQ, AWQ+GPTQ, GPTQ in compressed-tensors, sparse-bitmask outputs. Streamed == in memory tensor by
tensor (bitwise), configs equal; resume of a calibrated prune; a chain of calibrated stages in one pass
per layer. Same tiny sharded bf16 Llama as tests/test_streaming.py (every layer straddles two shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.engine import layers as layerwise
from geminicompress.engine.compose import OnePassFn, compose
from geminicompress.formats.checkpoint import read_tensors
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

runner = CliRunner()
CALIB = ["--samples", "4", "--calib-seq-len", "48"]



def _untimed(rows: list[dict]) -> list[dict]:
    """Per-layer summaries without their wall time (which differs from run to run)."""
    return [{k: v for k, v in r.items() if k != "layer_seconds"} for r in rows]

def run_streamed(recipe, out, **kwargs) -> dict:
    return run_recipe(recipe, out, RunOptions(stream=True, device=torch.device("cpu"), **kwargs))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


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
    assert _untimed(rm["layers"]) == _untimed(rs["layers"]) and rm["achieved_sparsity"] == rs["achieved_sparsity"]
    if "compressed-tensors" in args:
        assert any(k.endswith(".bitmask") for k in read_tensors(st))


@pytest.mark.parametrize("args", [
    ["--method", "w8a8"],  # SmoothQuant (alpha 0.5, the default): statistic from the float layers' inputs
    ["--method", "awq", "--group-size", "32"],  # AWQ GEMM
    ["--method", "awq", "--group-size", "32", "--format", "compressed-tensors"],
    ["--method", "awq+gptq", "--group-size", "32"],
    ["--method", "gptq", "--group-size", "32", "--format", "compressed-tensors", "--calib-dtype", "float32"],
    ["--method", "rtn", "--bits", "4", "--group-size", "32", "--asym"],  # GPTQ v1
    ["--method", "rtn", "--bits", "4", "--group-size", "32", "--format", "awq"],
])
def test_streamed_quantize_equals_in_memory_bitwise(sharded, tmp_path, args):
    mem, st = _both(sharded, tmp_path, "quantize", *args, *CALIB)
    _same_tensors(mem, st)
    rm, rs = _result(mem), _result(st)
    if "rtn" in args:
        assert {k: v for k, v in rs.items() if k != "streamed"} == rm  # the mean error too
    elif "w8a8" in args:
        assert rs["smoothquant"] == rm["smoothquant"] and rs["smoothquant"]["folded_groups"] > 0
        assert _untimed(rm["layers"]) == _untimed(rs["layers"])  # the largest scale and the error of every linear
    else:
        assert _untimed(rm["layers"]) == _untimed(rs["layers"])  # per layer: the searched alphas and errors, or the GPTQ losses
    if args[1].startswith("awq"):  # the saved search (scales, clips) too
        search_m, search_s = (read_tensors(d / "awq_search") for d in (mem, st))
        assert search_m.keys() == search_s.keys() and all(torch.equal(search_m[k], search_s[k]) for k in search_m)


@pytest.mark.parametrize("stage", [
    {"type": "prune", "method": "wanda", "sparsity": 0.5, "format": "compressed-tensors"},
    {"type": "quantize", "method": "w8a8"},  # SmoothQuant: the next inputs come from the float layers
])
def test_calibrated_run_resumes_after_a_crash_bitwise(sharded, tmp_path, crash_and_resume, stage):
    """Killed at layer 2: the next layer's inputs come back through layers 0-1 as written (Wanda only zeroes
    bf16 weights: exactly what the run computed with) or as read from the input (SmoothQuant's float
    layers), and the result equals an uninterrupted run."""
    recipe = recipe_from_stage(str(sharded), stage, {"samples": 4, "seq_len": 48}, "test")
    run_streamed(recipe, tmp_path / "straight", max_shard_bytes=40_000)
    resumed = lambda: run_streamed(recipe, tmp_path / "resumed", max_shard_bytes=40_000)  # noqa: E731
    crash_and_resume.kill(resumed, at=2)
    _, seen = crash_and_resume.resume(resumed)
    assert seen == [2]  # layers 0 and 1 were read back, not recomputed
    _same_tensors(tmp_path / "straight", tmp_path / "resumed")


# ---- several calibrated stages per layer ----
def test_consecutive_one_pass_stages_share_one_pass():
    """Two one-pass stages on a 4-linear llama layer: one forward per batch; in every group stage 0 solves
    before stage 1; stage 1 sees each group's input through the groups both stages solved already."""
    from geminicompress.core.arch import arch_for, decoder_layers
    from geminicompress.engine.layers import LayerJob, capture_inputs, forward_layer

    model = tiny_model("llama")
    inputs = capture_inputs(model, torch.randint(0, 384, (8, 16)), torch.device("cpu"))
    arch = arch_for(model)
    layer = decoder_layers(model)[0]
    groups = [list(g) for g in arch.sequential]
    events: list[tuple] = []
    calls = []
    layer.register_forward_pre_hook(lambda m, a: calls.append(1))

    def stage(k: int, factor: float):
        def fn(job):
            seen: dict[int, list[torch.Tensor]] = {}

            def solve(g: int) -> None:
                events.append((k, g))
                for n in groups[g]:
                    job.module(n).weight.data.mul_(factor)

            job.one_pass(groups, lambda g, x: seen.setdefault(g, []).append(x.clone()), solve)
            return {"groups": len(seen)}, {"x": torch.cat(seen[3])}  # down_proj's inputs
        return OnePassFn(fn)

    job = LayerJob(0, layer, inputs, torch.device("cpu"), arch)
    summary, kept = compose(stage(0, 0.5), stage(1, 0.9))(job)
    assert len(calls) == 2  # 8 windows in batches of 4: each ran through the layer once
    assert events == [(k, g) for g in range(4) for k in (0, 1)]
    assert summary == {"0.groups": 4, "1.groups": 4} and torch.equal(kept["0.x"], kept["1.x"])
    ref = forward_layer(layer, inputs, torch.device("cpu"))  # the solved layer: its outputs feed the next
    for a, b in zip(job.outputs, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.is_grad_enabled()


CHAIN = """\
model: {model}
calibration: {{samples: 8, seq_len: 48}}
stages:
  - {{type: prune, method: sparsegpt, sparsity: 0.5}}
  - {{type: quantize, method: gptq, bits: 4, group_size: 32, calib_dtype: float32, keep_zeros: true}}
"""


def test_a_chain_of_calibrated_stages_streams_in_one_pass_per_layer(sharded, tmp_path, monkeypatch):
    """sparsegpt 50% then gptq 4-bit from a YAML recipe: one calibration pass per layer (both stages'
    statistics from it), GPTQ v1 output. In memory the stages run one after the other over the whole model,
    so SparseGPT sees inputs that are not quantized yet: not the same numbers. Bound: the streamed chain is
    closer to the in-memory chain than the in-memory chain is to the dense model (it changes only which
    inputs SparseGPT's Hessians see, not what is done)."""
    from geminicompress.models.loading import load_model

    passes = []
    real = layerwise.one_pass
    monkeypatch.setattr(layerwise, "one_pass", lambda *a, **k: passes.append(1) or real(*a, **k))
    (tmp_path / "chain.yaml").write_text(CHAIN.format(model=sharded))
    res = invoke("run", tmp_path / "chain.yaml", "-o", tmp_path / "str", "-q", "--stream")
    assert res.exit_code == 0, res.output
    assert len(passes) == 3  # 3 layers, one pass each
    report = json.loads((tmp_path / "str" / "report.json").read_text())
    assert report["export"]["format"] == "gptq" and [s["stage"] for s in report["stages"]] == ["prune", "quantize:gptq"]
    res = invoke("run", tmp_path / "chain.yaml", "-o", tmp_path / "mem", "-q", "--no-stream", "--set", "output.dtype=bfloat16")
    assert res.exit_code == 0, res.output
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, path in (("dense", sharded), ("mem", tmp_path / "mem"), ("str", tmp_path / "str")):
        with torch.no_grad():
            model = load_model(str(path), dtype=torch.float32).model
            logits[name] = model(ids).logits
        if name != "dense":  # GPTQ kept SparseGPT's zeros (keep_zeros): every linear still half zero
            linears = [m for n, m in model.named_modules() if ".layers." in n and hasattr(m, "weight")
                       and n.endswith("proj")]
            assert len(linears) == 21
            assert min(float((m.weight == 0).float().mean()) for m in linears) >= 0.5
    gap = float((logits["str"] - logits["mem"]).norm())
    assert 0 < gap < float((logits["mem"] - logits["dense"]).norm())
