"""Which methods write the same bytes whatever the torch thread count (issue #28): each method runs with 1 and
with 2 threads on a model wide enough that torch splits its work over the threads (every matmul and reduction
above torch's grain size of 32,768 elements), and the outputs are compared bitwise.

Measured (and checked here): every method but GPTQ's solver (gptq, awq+gptq) writes the same bytes with 1 or 2
threads. GPTQ's Cholesky factor of H⁻¹ and its block updates (LAPACK, and matmuls of the shapes it uses) split
their work by thread count, and the last bits follow: those two are reproducible for a given thread count
(checked here: two runs, the same bytes), so pass `--threads N` for bytes that do not follow the machine's load;
a resumed run takes the interrupted run's count anyway (tests/test_resume.py). docs/streaming.md
("Reproducible bytes")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.formats.checkpoint import read_tensors
from tiny import tiny_model, tiny_tokenizer

runner = CliRunner()
CAL = ["--samples", "8", "--calib-seq-len", "64"]
GPTQ_CAL = ["--samples", "12", "--calib-seq-len", "64"]  # GPTQ wants a token per column of its widest layer (768)
METHODS = {
    "rtn": ["quantize", "--method", "rtn"],
    "int8": ["quantize", "--method", "int8"],
    "w8a8": ["quantize", "--method", "w8a8", *CAL],
    "gptq": ["quantize", "--method", "gptq", *GPTQ_CAL],
    "awq": ["quantize", "--method", "awq", "--n-grid", "3", *CAL],
    "awq+gptq": ["quantize", "--method", "awq+gptq", "--n-grid", "3", *GPTQ_CAL],
    "magnitude": ["prune"],
    "magnitude-2:4": ["prune", "--pattern", "2:4"],
    "wanda": ["prune", "--method", "wanda", *CAL],
    "sparsegpt": ["prune", "--method", "sparsegpt", *CAL],
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "model"
    tiny_model(hidden_size=256, intermediate_size=768, num_hidden_layers=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


THREAD_BOUND = {"gptq", "awq+gptq"}  # the same bytes for a given thread count only


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("name", list(METHODS))
def test_the_same_bytes_with_one_thread_or_two(wide, tmp_path, name, stream):
    """The same bytes with 1 or 2 threads; for GPTQ's solver, with 2 threads twice."""
    args = METHODS[name]
    runs = (2, 2) if name in THREAD_BOUND else (1, 2)
    for k, threads in enumerate(runs):
        res = runner.invoke(app, [args[0], str(wide), *args[1:], "-o", str(tmp_path / str(k)), "-q",
                                  "--threads", str(threads), "--no-verify", "--stream" if stream else "--no-stream"])
        assert res.exit_code == 0, res.output
    one, two = read_tensors(tmp_path / "0"), read_tensors(tmp_path / "1")
    assert set(one) == set(two)
    assert all(torch.equal(one[k].view(torch.uint8), two[k].view(torch.uint8)) for k in one), name
