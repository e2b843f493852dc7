"""Weights must match the config (issue #34): a config.json that promises more layers than the checkpoint holds is
refused in one line, exit 2, before any work and with nothing written, by every command, in memory and streamed
(transformers' loading info in memory; the skeleton check streamed); a tensor the model does not use is one
warning line and is not written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import save_sharded
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.formats.checkpoint import read_tensors
from geminicompress.host.output import partial_dir

runner = CliRunner()
COMMANDS = {"int8": ["quantize", "--method", "int8"], "gptq": ["quantize", "--method", "gptq", "--group-size", "32"],
            "rtn": ["quantize", "--method", "rtn", "--group-size", "32"], "prune": ["prune"]}
SMALL = ["--samples", "4", "--calib-seq-len", "32", "--threads", "1", "-q"]


@pytest.fixture(scope="module")
def lying(tmp_path_factory) -> Path:
    """3 layers of weights under a config.json that says 5."""
    path = save_sharded(tmp_path_factory.mktemp("lie") / "tiny", num_hidden_layers=3)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def extra(tmp_path_factory) -> Path:
    """A checkpoint with one tensor more than its model uses."""
    path = save_sharded(tmp_path_factory.mktemp("extra") / "tiny", num_hidden_layers=2)
    save_file({"model.unused_probe.weight": torch.ones(4, 4, dtype=torch.bfloat16)}, str(path / "extra.safetensors"),
              metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.unused_probe.weight"] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip() and "Writing model shards" not in line]


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_config_promising_more_layers_than_the_weights_is_refused(lying, tmp_path, command, stream):
    out = tmp_path / "out"
    result = runner.invoke(app, [*COMMANDS[command][:1], str(lying), "-o", str(out), *COMMANDS[command][1:], stream,
                                 *SMALL])
    assert result.exit_code == 2, result.output
    lines = _lines(result)
    assert len(lines) == 1 and "internal error" not in lines[0], result.output
    assert "model.layers.3." in lines[0] and "is missing from the checkpoint (config.json needs it" in lines[0]
    assert not out.exists() and not partial_dir(out).exists()


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_an_unused_tensor_is_one_warning_and_not_written(extra, tmp_path, stream):
    out = tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(extra), "-o", str(out), "--method", "int8", stream, *SMALL])
    assert result.exit_code == 0, result.output
    warnings = [line for line in _lines(result) if line.startswith("warning:")]
    assert len(warnings) == 1 and "model.unused_probe.weight" in warnings[0] and "not written" in warnings[0]
    assert "model.unused_probe.weight" not in read_tensors(out)
