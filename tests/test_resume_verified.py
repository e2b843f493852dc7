"""A resumed run is verified like any other (issue #34): the probe runs through the layers an earlier process
finished, in memory as the run computed them, streamed as rebuilt from what was written; a finished layer whose
bytes were damaged on disk between the kill and the rerun fails the check of a run in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geminicompress.core.errors import GeminiError
from geminicompress.host.output import partial_dir
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
STAGES = {
    "gptq": {"type": "quantize", "method": "gptq", "group_size": 32},
    "rtn": {"type": "quantize", "method": "rtn", "group_size": 32},
    "sparsegpt": {"type": "prune", "method": "sparsegpt", "sparsity": 0.5},
    "int8": {"type": "quantize", "method": "int8"},
}


def _killed_then_resumed(recipe, out: Path, stream: bool, crash_and_resume, kill_at: int = 2, between=None) -> dict:
    crash_and_resume.kill(lambda: run_recipe(recipe, out, RunOptions(device=CPU, stream=stream)), at=kill_at,
                          error=KeyboardInterrupt())
    assert partial_dir(out).is_dir()
    if between is not None:
        between(partial_dir(out))
    return run_recipe(recipe, out, RunOptions(device=CPU, stream=stream))


@pytest.mark.parametrize("name, stream", [("gptq", False), ("int8", False), ("gptq", True), ("rtn", True),
                                          ("sparsegpt", True)])
def test_a_resumed_run_is_verified(sharded, tmp_path, crash_and_resume, name, stream):
    recipe = recipe_from_stage(str(sharded), STAGES[name], {"samples": 8, "seq_len": 32}, "test")
    report = _killed_then_resumed(recipe, tmp_path / "out", stream, crash_and_resume)
    verified = report["export"]["verified"]
    assert "skipped" not in verified, verified
    assert verified["max_abs_logit_diff"] <= verified["tolerance"]


def test_a_finished_layer_damaged_on_disk_fails_the_check_of_a_resumed_run(sharded, tmp_path, crash_and_resume):
    recipe = recipe_from_stage(str(sharded), STAGES["rtn"], {}, "test")

    def damage(partial: Path) -> None:
        state = partial / "state" / "out" / "shards"
        progress = json.loads((state / "progress.json").read_text())
        meta = progress["open"]["tensors"]
        name = next(n for n in meta if n.endswith("mlp.down_proj.scales"))  # layer 0's, already written
        start, stop = meta[name]["data_offsets"]
        data = state / "part-00001.data"
        raw = bytearray(data.read_bytes())
        at = progress["open"]["reserve"] + start
        raw[at:at + (stop - start)] = bytes(stop - start)  # its scales zeroed
        data.write_bytes(bytes(raw))

    with pytest.raises(GeminiError, match="verification failed"):
        _killed_then_resumed(recipe, tmp_path / "out", False, crash_and_resume, between=damage)


def test_an_in_memory_w8a8_run_killed_while_writing_resumes_to_the_same_bytes(sharded, tmp_path, crash_and_resume):
    """Its finished layers' saved state holds INT8 modules (weight_scale) that a float layer cannot take: the walk
    computes them again (sinks.ResidentSink.restore), which gives the same bytes."""
    from geminicompress.formats.checkpoint import read_tensors

    recipe = recipe_from_stage(str(sharded), {"type": "quantize", "method": "w8a8"}, {"samples": 4, "seq_len": 32},
                               "test")
    run_recipe(recipe, tmp_path / "straight", RunOptions(device=CPU, stream=False))
    report = _killed_then_resumed(recipe, tmp_path / "out", False, crash_and_resume, kill_at=1)
    assert "skipped" not in report["export"]["verified"]
    a, b = read_tensors(tmp_path / "straight"), read_tensors(tmp_path / "out")
    assert set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
