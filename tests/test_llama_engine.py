"""`eval --engine llama.cpp` without llama.cpp: the missing-engine line, the driver's tasks against a stand-in
llama_cpp package (tests/fake_llama_cpp), the figures (perplexity, the binned KL, top-1), a whole evaluation
through the real driver protocol, and the refusal of a directory this build cannot export. One slow test runs
real llama.cpp where /work/venv-llama (or $GEMINICOMPRESS_LLAMA_PYTHON) has it."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geminicompress.core.errors import InputError
from geminicompress.eval.engines import llama_eval
from geminicompress.eval.engines.llama_eval import binned_kl
from geminicompress.host.progress import NullProgress
from geminicompress.eval.config import EvalStage

FAKE = Path(__file__).parent / "fake_llama_cpp"
sys.path.insert(0, str(FAKE))
from llama_cpp import fake_logits  # noqa: E402

sys.path.remove(str(FAKE))
sys.modules.pop("llama_cpp", None)


@pytest.fixture
def fake_llama(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    return sys.executable


def _model(tmp_path: Path, name: str, noise: float, vocab: int = 40) -> str:
    path = tmp_path / f"{name}.gguf"
    path.write_text(json.dumps({"vocab": vocab, "noise": noise, "seed": 3}))
    return str(path)


def test_no_llama_cpp_names_the_install_command(monkeypatch):
    monkeypatch.delenv(llama_eval.ENV_PYTHON, raising=False)
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is importable in this python")
    with pytest.raises(InputError, match='CMAKE_ARGS="-DGGML_NATIVE=OFF .*pip install llama-cpp-python'):
        llama_eval.find_python(None)
    with pytest.raises(InputError, match="does not exist"):
        llama_eval.find_python("/nonexistent/python")


def test_binned_kl_is_exact_with_every_token_and_a_lower_bound_with_fewer():
    gen = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(50, 30, generator=gen, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(50, 30, generator=gen, dtype=torch.float64), -1)
    full = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(binned_kl(p, q), full, atol=1e-9)  # k = vocabulary: the rest bin is empty
    top = p.topk(5, dim=-1).indices
    partial = binned_kl(p.gather(-1, top), q.gather(-1, top))
    assert torch.all(partial <= full + 1e-12) and torch.all(partial >= -1e-12)
    assert float(partial.mean()) > 0.1 * float(full.mean())


def test_driver_logprobs_decode_and_quantize_tasks(fake_llama, tmp_path):
    model = _model(tmp_path, "m", 0.0)
    window = [1, 5, 7, 2, 9]
    job = {"model": model, "threads": 2, "n_ctx": 64, "tasks": [
        {"kind": "logprobs", "windows": [window], "top_k": 3, "at": None},
        {"kind": "decode", "prompt": [1, 2, 3], "gen_len": 4, "warmup": 1, "repeats": 2},
        {"kind": "bench", "pp": 16, "tg": 4, "warmup": 1, "repeats": 3},
        {"kind": "quantize", "src": model, "dst": str(tmp_path / "q.gguf"), "ftype": "Q4_0",
         "allow_requantize": True, "imatrix": {"blk.0.attn_q.weight": [1.0, 2.0]}}]}
    result = llama_eval.run_driver(fake_llama, job)
    assert result["error"] is None and result["threads"] == 2 and result["llama_cpp"] == "0.0-fake"
    lp, dec, bench, quant = result["tasks"]
    table = fake_logits({"vocab": 40})
    greedy = [int(table[3].argmax())]  # the prompt's last token, then each generated one
    for _ in range(3):
        greedy.append(int(table[greedy[-1]].argmax()))
    assert all(r["tokens"] == greedy for r in dec["runs"]), (dec["runs"][0]["tokens"], greedy)
    assert len(bench["pp_s"]) == 3 and len(bench["tg_s"]) == 3 and min(bench["pp_s"] + bench["tg_s"]) > 0
    ref = table[window[:-1]] - np.log(np.exp(table[window[:-1]]).sum(-1, keepdims=True))
    assert np.allclose(lp["logprobs"][0], ref[np.arange(4), window[1:]], atol=1e-5)
    assert lp["top1"][0] == ref.argmax(-1).tolist()
    assert sorted(lp["topk_ids"][0][0]) == sorted(np.argsort(-ref[0])[:3].tolist())
    assert len(dec["runs"]) == 2 and all(len(r["token_s"]) == 3 for r in dec["runs"])
    written = json.loads(Path(quant["dst"]).read_text())
    assert written["ftype"] == 2 and written["imatrix"] == [["blk.0.attn_q.weight", [1.0, 2.0]]]


def test_driver_reports_a_refused_file_in_one_line(fake_llama, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("not json")
    result = llama_eval.run_driver(fake_llama, {"model": str(bad), "tasks": [
        {"kind": "logprobs", "windows": [[1, 2]], "top_k": 0, "at": None}]})
    assert result["error"].startswith("JSONDecodeError") and result["log"]


def test_evaluate_in_the_fake_engine(fake_llama, tmp_path, monkeypatch):
    base, noisy = _model(tmp_path, "base", 0.0), _model(tmp_path, "noisy", 0.7)
    ids = torch.tensor(np.random.default_rng(5).integers(0, 40, 64))
    monkeypatch.setattr(llama_eval, "tokenizer_for", lambda spec, trust: None)
    monkeypatch.setattr(llama_eval, "tokenize", lambda tok, text, n: ids)
    monkeypatch.setattr(llama_eval, "text_prefix", lambda tok, frame, vocab: ())  # a tokenizer that adds no BOS
    monkeypatch.setattr(llama_eval, "prefix_note", lambda tok, prefix: {"prefix_ids": list(prefix)})
    monkeypatch.setattr(llama_eval, "read_text", lambda data, col: "text")
    options = EvalStage(type="eval", data="x", seq_len=16, prompt_len=8, gen_len=4, repeats=2, llama_python=fake_llama)
    report = llama_eval.evaluate_llama([base, noisy], ["base", "noisy"], "x", options, NullProgress())
    b, n = report["models"]
    assert report["engine"] == "llama.cpp" and b["quality"]["kl_to_baseline"] == 0.0
    assert b["quality"]["top1_agreement"] == 1.0 and n["quality"]["kl_is_lower_bound"]
    # the figures from the fake logits themselves
    windows = ids.view(4, 16).numpy()
    t0, t1 = fake_logits({"vocab": 40}), fake_logits({"vocab": 40, "noise": 0.7, "seed": 3})
    lsm = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))  # noqa: E731
    p, q = lsm(t0[windows[:, :-1]].astype(np.float64)), lsm(t1[windows[:, :-1]].astype(np.float64))
    nll = -np.take_along_axis(q, windows[:, 1:, None], -1).mean()
    assert n["quality"]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    full_kl = (np.exp(p) * (p - q)).sum(-1).mean()
    assert 0 < n["quality"]["kl_to_baseline"] <= full_kl + 1e-9
    assert n["quality"]["top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean(), abs=1e-6)
    assert n["latency"]["threads"] >= 1 and n["latency"]["tpot_ms"]["median"] >= 0
    assert n["quality"]["kl_to_baseline"] <= n["quality"]["kl_p99"]  # the tail above the mean
    bench = n["llama_bench"]  # llama-bench's figures: tokens per second, 512 / 128 over each run's time
    assert bench["threads"] == n["latency"]["threads"] and len(bench["pp512_runs"]) == 2
    assert bench["pp512_tok_s"] > 0 and bench["tg128_tok_s"] > 0 and n["linear_bits_per_weight"] is None  # not a GGUF
    from geminicompress.eval.table import llama_lines

    lines = llama_lines(report)
    assert len(lines) == 2 and lines[1].startswith("noisy: KL p99") and f"tg128 {bench['tg128_tok_s']:.1f} tok/s" in lines[1]


def test_a_directory_needs_the_exporter_or_its_model_gguf(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "geminicompress.formats.gguf_export", None)  # this build without the exporter
    with pytest.raises(InputError, match="--format gguf"):
        llama_eval.gguf_for(str(out), sys.executable, tmp_path)
    (out / "model.gguf").write_text("x")
    assert llama_eval.gguf_for(str(out), sys.executable, tmp_path) == out.resolve() / "model.gguf"


REAL = os.environ.get(llama_eval.ENV_PYTHON) or "/work/venv-llama/bin/python"


@pytest.mark.slow
def test_real_llama_cpp_scores_the_demo(tmp_path):
    """The demo as F32 in real llama.cpp: its perplexity against itself, on two 128-token windows."""
    if not Path(REAL).is_file() or os.system(f"{REAL} -c 'import llama_cpp' 2>/dev/null") != 0:
        pytest.skip("llama-cpp-python is not installed")
    from geminicompress.eval.api import evaluate

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-test.txt"
    options = EvalStage(type="eval", data=str(data), seq_len=128, max_tokens=256, latency=False, engine="llama.cpp",
                        llama_python=REAL)
    report = evaluate([], "smollm2-demo", str(data), None, options)
    q = report["models"][0]["quality"]
    assert q["tokens"] == 254 and 5 < q["perplexity"] < 200
