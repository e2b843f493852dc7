"""Inputs that lie (issue #28): a checkpoint with NaN/Inf weights stops every command that reads it, in one line
naming the tensor, exit 2, no OUT (and no partial folder); activations that overflow name the layer and the
window; the export check blames the input when the input itself gives non-finite logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.models.finite import NonFiniteError, check, nonfinite

runner = CliRunner()
V = "model.layers.1.self_attn.v_proj.weight"


def _broken(path: Path, value: float, where: str = V, rows=(3, 7), count: int = 5) -> Path:
    """A tiny Llama in bfloat16 shards with `count` values of `where` set to `value`."""
    model = tiny_model(num_hidden_layers=3)
    with torch.no_grad():
        w = model.get_parameter(where)
        w.view(-1)[torch.arange(count) * 11 + rows[0] * w.shape[-1]] = value
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Path:
    return _broken(tmp_path_factory.mktemp("nan") / "model", float("nan"))


@pytest.fixture(scope="module")
def inf_model(tmp_path_factory) -> Path:
    return _broken(tmp_path_factory.mktemp("inf") / "model", float("inf"))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


CAL = ["--samples", "4", "--calib-seq-len", "32"]
COMMANDS = {
    "int8": ["quantize", "--method", "int8"],
    "w8a8": ["quantize", "--method", "w8a8", *CAL],
    "rtn": ["quantize", "--method", "rtn", "--group-size", "32"],
    "gptq": ["quantize", "--method", "gptq", "--group-size", "32", "--samples", "8", "--calib-seq-len", "32"],
    "awq": ["quantize", "--method", "awq", "--group-size", "32", "--n-grid", "2", *CAL],
    "awq+gptq": ["quantize", "--method", "awq+gptq", "--group-size", "32", "--n-grid", "2", "--samples", "8",
                 "--calib-seq-len", "32"],
    "magnitude": ["prune"],
    "magnitude-layer": ["prune", "--scope", "layer"],
    "wanda": ["prune", "--method", "wanda", *CAL],
    "sparsegpt": ["prune", "--method", "sparsegpt", *CAL],
}


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_nan_weights_stop_every_method_before_any_work(nan_model, tmp_path, name, stream):
    args = COMMANDS[name]
    res = invoke(args[0], nan_model, *args[1:], "-o", tmp_path / "out", "-q", "--threads", "1",
                 "--stream" if stream else "--no-stream")
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert f"{V} holds 5 non-finite values (the first, NaN, at [3, 0])" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # no OUT, no hidden partial folder


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_inf_weights_too(inf_model, tmp_path, stream):
    res = invoke("quantize", inf_model, "--method", "int8", "-o", tmp_path / "out", "-q",
                 "--stream" if stream else "--no-stream")
    assert res.exit_code == 2 and "(the first, +Inf, at [3, 0])" in res.output, res.output
    assert list(tmp_path.iterdir()) == []


def test_distill_and_eval_refuse_it_too(nan_model, text_file, tmp_path):
    res = invoke("distill", "--teacher", nan_model, "--student-layers", "0.5", "--data", text_file, "--steps", "1",
                 "--seq-len", "16", "-o", tmp_path / "student", "-q")
    assert res.exit_code == 2 and f"{V} holds 5 non-finite values" in res.output, res.output
    assert not (tmp_path / "student").exists()
    res = invoke("eval", nan_model, "--data", text_file, "--no-latency", "-o", tmp_path / "report", "-q")
    assert res.exit_code == 2 and f"{V} holds 5 non-finite values" in res.output, res.output


def test_allow_nonfinite_goes_on_and_records_what_it_found(nan_model, tmp_path):
    res = invoke("quantize", nan_model, "--method", "int8", "-o", tmp_path / "out", "-q", "--allow-nonfinite")
    assert res.exit_code == 0, res.output
    found = json.loads((tmp_path / "out" / "report.json").read_text())["input_nonfinite"]
    assert [(f["tensor"], f["count"], f["first_index"]) for f in found] == [(V, 5, [3, 0])]


def test_overflowing_activations_name_the_layer_and_the_window(tmp_path):
    """Finite weights whose layer 1 outputs overflow: the calibration stops naming the layer and the window."""
    model = tiny_model(num_hidden_layers=3)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(3e38)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    res = invoke("quantize", tmp_path / "model", "--method", "gptq", "--group-size", "32", "--samples", "8",
                 "--calib-seq-len", "32", "-o", tmp_path / "out", "-q")
    assert res.exit_code == 2, res.output
    assert "calibration window 0: the activations after decoder layer 1 hold" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_the_export_check_blames_an_input_that_gives_nonfinite_logits(tmp_path):
    """A head so large that the logits overflow: the input's fault (exit 2), not a writer bug."""
    model = tiny_model(num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    res = invoke("quantize", tmp_path / "model", "--method", "int8", "-o", tmp_path / "out", "-q")
    assert res.exit_code == 2, res.output
    assert "itself gives non-finite logits on the check's probe tokens" in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_the_export_check_blames_the_run_when_only_the_output_is_nonfinite(tiny_dir, tmp_path, monkeypatch):
    from geminicompress.compress.rtn import stage as rtn

    real = rtn.quantize_linear

    def broken(weight, spec, scales_as):
        qw, err = real(weight, spec, scales_as)
        weight.data.fill_(float("inf"))  # a method that breaks the model it writes
        return qw, err

    monkeypatch.setattr(rtn, "quantize_linear", broken)
    res = invoke("quantize", tiny_dir, "--method", "rtn", "--group-size", "32", "--format", "dense", "-o",
                 tmp_path / "out", "-q")
    assert res.exit_code == 1, res.output
    assert "while the input model does not: the compression broke it" in res.output, res.output


def test_the_check_finds_count_and_first_index_without_a_full_temporary():
    t = torch.zeros(3000, 40)
    assert nonfinite(t) is None
    t[2999, 39] = float("-inf")
    t[1200, 3] = float("nan")
    assert nonfinite(t, rows=512) == (2, [1200, 3])
    with pytest.raises(NonFiniteError, match=r"w holds 2 non-finite values \(the first, NaN, at \[1200, 3\]\)"):
        check("w", t.to(torch.bfloat16), allow=False)
    found = []
    check("w", t, allow=True, found=found)
    assert found[0]["count"] == 2
    big = torch.full((4,), 3e38)  # finite, but the sum overflows: the exact pass says all is well
    assert nonfinite(big) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_from_the_files_finds_what_the_check_of_the_model_finds(tmp_path, dtype):
    """A model loaded in its stored dtype is checked from its files (models/finite.check_stored), in blocks
    that here split tensors across reads: the same tensors, counts, first indices and line as the check of
    the loaded state dict, and the loaded model in that dtype takes that path."""
    from geminicompress.models.finite import check_named, check_stored
    from geminicompress.models.headers import read_headers
    from geminicompress.models.loading import load_model

    path = tmp_path / "model"
    model = tiny_model(num_hidden_layers=3).to(dtype)
    with torch.no_grad():
        model.get_parameter(V).view(-1)[[7, 300, 301]] = float("nan")
        model.get_parameter("model.layers.2.mlp.down_proj.weight").view(-1)[-1] = float("-inf")
    model.save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    headers = read_headers(path)
    assert len({i.file for i in headers.values()}) > 1  # several shards
    want = check_named(model.state_dict().items(), allow=True)
    got = check_stored(headers, allow=True, block_bytes=96)  # 96 bytes: many reads per tensor
    assert sorted((f["tensor"], f["count"], f["first_index"], f["what"]) for f in got) == \
        sorted((f["tensor"], f["count"], f["first_index"], f["what"]) for f in want)
    assert len(got) == 2
    with pytest.raises(NonFiniteError, match=r"holds 3 non-finite values \(the first, NaN, at \[0, 7\]\)"):
        check_stored(headers, allow=False)
    loaded = load_model(str(path), dtype=dtype, allow_nonfinite=True)
    assert sorted(f["tensor"] for f in loaded.nonfinite) == sorted(f["tensor"] for f in want)
