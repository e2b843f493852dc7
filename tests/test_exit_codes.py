"""Exit codes a script can trust (issue #34, docs/install.md "Exit codes"): a missing tokenizer is bad input
(exit 2, a whole sentence naming the missing files, before the weights load)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.host.output import partial_dir

runner = CliRunner()


@pytest.fixture
def no_tokenizer(tiny_dir, tmp_path) -> Path:
    path = tmp_path / "no-tok"
    shutil.copytree(tiny_dir, path)
    for f in path.glob("tokenizer*"):
        f.unlink()
    return path


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_a_missing_tokenizer_is_exit_2_with_a_whole_sentence(no_tokenizer, tmp_path, stream):
    out = tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(no_tokenizer), "-o", str(out), "--method", "int8", stream, "-q"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0] == (f"error: {no_tokenizer} has no tokenizer: tokenizer.json, tokenizer.model and "
                        "tokenizer_config.json are missing; copy the tokenizer files of the model these weights come "
                        "from into it.")
    assert not out.exists() and not partial_dir(out).exists()


def test_eval_of_a_model_without_tokenizer_fails_that_model_and_exits_1(tiny_dir, no_tokenizer, tmp_path, text_file):
    out = tmp_path / "rep"
    result = runner.invoke(app, ["eval", str(tiny_dir), str(no_tokenizer), "--data", str(text_file), "-o", str(out),
                                 "--seq-len", "64", "--max-tokens", "256", "--no-latency", "-q", "--threads", "1"])
    assert result.exit_code == 1, result.output
    assert (out / "report.json").is_file()  # the others' report is still written
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 2 models failed: ") and "no-tok" in last, last
