"""A resumed run writes the bytes of the run it replaces (issue #28): killed at any layer and rerun, a streamed
GPTQ, AWQ or SparseGPT run equals an uninterrupted one; the next layer's inputs are recomputed as they were
computed (the same batching) or, where the written layer cannot give them back exactly, read from the resume
state; the thread count is recorded and a resumed run takes the interrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import save_sharded
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.engine import layers as layers_mod
from geminicompress.engine.sinks import ShardSink
from geminicompress.formats.checkpoint import read_tensors
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
runner = CliRunner()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save_sharded(tmp_path_factory.mktemp("resume") / "tiny-bf16", num_hidden_layers=4)


def _same(a: Path, b: Path) -> None:
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k


STAGES = {
    "gptq": {"type": "quantize", "method": "gptq", "group_size": 32},
    "awq": {"type": "quantize", "method": "awq", "group_size": 32, "n_grid": 3},
    "sparsegpt": {"type": "prune", "method": "sparsegpt", "sparsity": 0.5},
}


@pytest.mark.parametrize("kill_at", [0, 2, 3], ids=["first", "middle", "last"])
@pytest.mark.parametrize("name", list(STAGES))
def test_a_killed_streamed_run_resumes_to_the_same_bytes(sharded, tmp_path, monkeypatch, name, kill_at):
    recipe = recipe_from_stage(str(sharded), STAGES[name], {"samples": 8, "seq_len": 32}, "test")
    run_recipe(recipe, tmp_path / "straight", RunOptions(device=CPU, stream=True))
    finish = ShardSink.finish

    def killed(self, i, layer, summary, kept):
        if i == kill_at:
            raise KeyboardInterrupt  # as a kill: nothing after this point runs
        return finish(self, i, layer, summary, kept)

    monkeypatch.setattr(ShardSink, "finish", killed)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, tmp_path / "resumed", RunOptions(device=CPU, stream=True))
    monkeypatch.undo()
    report = run_recipe(recipe, tmp_path / "resumed", RunOptions(device=CPU, stream=True))
    if name != "sparsegpt":  # (a prune stage's `layers` are its linears' rows)
        assert [bool(x.get("resumed")) for x in report["stages"][0]["result"]["layers"]] == [i < kill_at for i in range(4)]
    _same(tmp_path / "straight", tmp_path / "resumed")


def test_awq_keeps_the_exact_inputs_and_gptq_recomputes_them_batched_as_before(sharded, tmp_path, monkeypatch):
    """AWQ's folded norms are written in bfloat16 but computed in float32: the exact inputs of the next layer
    are kept with the resume state. GPTQ's layer is written exactly: its next inputs are recomputed, in the
    batches its one pass ran them in (4 windows), not one window at a time."""
    calls = []
    real = layers_mod.forward_layer

    def spy(layer, inputs, device, observe=None, keep_outputs=True, batch=1, into=None):
        calls.append(batch)
        return real(layer, inputs, device, observe, keep_outputs, batch, into)

    for name, kept_inputs in (("awq", True), ("gptq", False)):
        recipe = recipe_from_stage(str(sharded), STAGES[name], {"samples": 8, "seq_len": 32}, "test")
        finish = ShardSink.finish
        monkeypatch.setattr(ShardSink, "finish", lambda self, i, *a: (_ for _ in ()).throw(KeyboardInterrupt) if i == 2
                            else finish(self, i, *a))
        with pytest.raises(KeyboardInterrupt):
            run_recipe(recipe, tmp_path / name, RunOptions(device=CPU, stream=True))
        state = tmp_path / f".{name}.partial" / "state" / "stream" / "inputs"
        assert state.is_dir() == kept_inputs
        monkeypatch.setattr(ShardSink, "finish", finish)
        monkeypatch.setattr("geminicompress.engine.walk.forward_layer", spy)
        calls.clear()
        run_recipe(recipe, tmp_path / name, RunOptions(device=CPU, stream=True))
        monkeypatch.setattr("geminicompress.engine.walk.forward_layer", real)
        if name == "gptq":
            assert calls[:2] == [4, 4]  # layers 0 and 1 recomputed in the one pass's batches
        else:
            assert all(b == 1 for b in calls)  # AWQ's own passes are one window at a time; none recomputes 0-1


def test_the_thread_count_is_recorded_and_a_resumed_run_takes_it(sharded, tmp_path, monkeypatch):
    args = ["quantize", str(sharded), "--method", "gptq", "--group-size", "32", "--samples", "8", "--calib-seq-len",
            "32", "--stream", "-q", "-o", str(tmp_path / "out")]
    finish = ShardSink.finish
    monkeypatch.setattr(ShardSink, "finish", lambda self, i, *a: (_ for _ in ()).throw(RuntimeError("killed"))
                        if i == 1 else finish(self, i, *a))
    res = runner.invoke(app, [*args, "--threads", "1"])
    assert res.exit_code == 1 and "killed" in res.output
    monkeypatch.setattr(ShardSink, "finish", finish)
    threads = json.loads((tmp_path / ".out.partial" / "state" / "threads.json").read_text())["threads"]
    assert threads == 1
    res = runner.invoke(app, args)  # no --threads: the interrupted run's count, whatever the machine's load
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / "report.json").read_text())["threads"] == 1
