"""Verified on the way out (verify.py, streaming/verify.py): OUT loaded back reproduces the in-process
logits for every format, in memory and streamed, loaded in memory and one layer at a time; a corrupted
write fails in one line and leaves no OUT; --no-verify skips the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import save_sharded
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.engine import verify
from geminicompress.core.errors import GeminiError
from geminicompress.formats import gptq as gptq_format
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

runner = CliRunner()
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    return save_sharded(tmp_path_factory.mktemp("verify") / "bf16", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> Path:
    return save_sharded(tmp_path_factory.mktemp("verify") / "fp32", dtype=torch.float32,
                        tie_word_embeddings=True)


def _run(model_dir: Path, stage: dict, out: Path, *, stream: bool, data: Path, **top) -> dict:
    recipe = recipe_from_stage(str(model_dir), stage, {"data": str(data), "samples": 4, "seq_len": 64}, "test", **top)
    return run_recipe(recipe, out, RunOptions(device=CPU, stream=stream))


STAGES = {
    "prune": {"type": "prune", "sparsity": 0.4},
    "prune-2:4-bitmask": {"type": "prune", "pattern": "2:4", "format": "compressed-tensors"},
    "int8": {"type": "quantize", "method": "int8"},
    "int8-head": {"type": "quantize", "method": "int8", "ignore": []},  # the output head quantized too
    "w8a8": {"type": "quantize", "method": "w8a8"},
    "gptq": {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16},
    "gptq-pack-quantized": {"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16,
                            "format": "compressed-tensors"},
    "awq": {"type": "quantize", "method": "awq", "bits": 4, "group_size": 16},
}


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory-run", "streamed-run"])
@pytest.mark.parametrize("name", list(STAGES))
def test_every_format_is_verified(bf16, text_file, tmp_path, name, stream):
    report = _run(bf16, STAGES[name], tmp_path / "out", stream=stream, data=text_file, output={"dtype": "bfloat16"})
    v = report["export"]["verified"]
    assert report["export"].get("streamed", False) is stream
    assert v["windows"] == [2, 64] and v["dtype"] == "bfloat16"
    assert v["loaded"] == ("streamed" if stream else "in-memory")  # a streamed run reads OUT as it wrote it
    assert v["max_abs_logit_diff"] <= v["tolerance"] == pytest.approx(1e-4 * v["max_abs_logit"], rel=1e-3)
    assert v["max_abs_logit"] > 0.5  # real logits, not an empty comparison
    assert (v["storage_rounding_diff"] is None) is stream  # a streamed run carries its layers as stored only
    assert json.loads((tmp_path / "out" / "report.json").read_text())["export"]["verified"] == v


def test_in_memory_run_with_float32_input_and_bfloat16_output_records_the_rounding(fp32, text_file, tmp_path):
    """The in-process model is compared as stored (bf16), exactly; what bf16 storage moved is recorded apart."""
    report = _run(fp32, STAGES["gptq"], tmp_path / "g", stream=False, data=text_file, output={"dtype": "bfloat16"})
    v = report["export"]["verified"]
    assert v["max_abs_logit_diff"] <= v["tolerance"] and v["storage_rounding_diff"] > 10 * v["tolerance"]
    report = _run(fp32, STAGES["gptq"], tmp_path / "g32", stream=False, data=text_file)
    assert report["export"]["verified"]["storage_rounding_diff"] == 0.0


def test_loaded_back_one_layer_at_a_time_when_big(fp32, text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(verify, "too_big", lambda out: True)
    report = _run(fp32, STAGES["gptq"], tmp_path / "out", stream=False, data=text_file)
    v = report["export"]["verified"]
    assert v["loaded"] == "streamed" and v["max_abs_logit_diff"] <= v["tolerance"]


def _flip_codes(pack):
    """A packer that writes the codes of every output row reversed along the input (a layout bug)."""

    def broken(qw):
        from dataclasses import replace

        return pack(replace(qw, q=qw.q.flip(1).contiguous()))

    return broken


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory-run", "streamed-run"])
def test_corrupted_write_fails_in_one_line_and_leaves_no_output(bf16, text_file, tmp_path, monkeypatch, stream):
    monkeypatch.setattr(gptq_format, "pack_gptq", _flip_codes(gptq_format.pack_gptq))
    args = ["quantize", str(bf16), "--method", "gptq", "--bits", "4", "--group-size", "16", "--samples", "4",
            "--calib-seq-len", "64", "--data", str(text_file), "-q", "--stream" if stream else "--no-stream"]
    out = tmp_path / "broken"
    res = runner.invoke(app, [*args, "-o", str(out)])
    assert res.exit_code != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "verification failed: the written checkpoint's logits differ" in lines[0]
    assert not out.exists()  # the hidden partial folder may keep a resume state (output.py), nothing else counts
    partial = tmp_path / ".broken.partial"
    assert not partial.exists() or (partial / "state").is_dir()
    # the check is what failed it: without it the broken checkpoint is written
    res = runner.invoke(app, [*args, "-o", str(out), "--no-verify"])
    assert res.exit_code == 0, res.output
    assert "verified" not in json.loads((out / "report.json").read_text())["export"]


def test_one_corrupted_module_is_enough(bf16, text_file, tmp_path, monkeypatch):
    """Only the first packed module's codes written reversed: still far beyond the bound."""
    pack, calls = gptq_format.pack_gptq, []

    def first_broken(qw):
        calls.append(1)
        return _flip_codes(pack)(qw) if len(calls) == 1 else pack(qw)

    monkeypatch.setattr(gptq_format, "pack_gptq", first_broken)
    with pytest.raises(GeminiError, match="verification failed") as info:
        _run(bf16, STAGES["gptq"], tmp_path / "o", stream=True, data=text_file)
    assert len(calls) == 3 * 7 and not (tmp_path / "o").exists()
    assert len(str(info.value).splitlines()) == 1


def test_no_verify_flag_is_documented():
    for command in ("quantize", "prune", "run"):
        res = runner.invoke(app, [command, "--help"])
        assert "--no-verify" in res.output and "costs" in res.output.replace("\n", " ")


def test_in_process_model_holds_the_stored_values_after_the_check(fp32, text_file, tmp_path):
    """After the check the in-memory model computes what OUT computes (its floats rounded as stored)."""
    recipe = recipe_from_stage(str(fp32), STAGES["int8"], {}, "test", output={"dtype": "bfloat16"})
    loaded = load_model(str(fp32))
    run_recipe(recipe, tmp_path / "o", RunOptions(device=CPU), loaded=loaded)
    ids = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(1))
    back = load_model(str(tmp_path / "o"), dtype=torch.float32).model
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, back(ids).logits, rtol=0, atol=1e-5)
    assert next(loaded.model.parameters()).dtype == torch.float32
