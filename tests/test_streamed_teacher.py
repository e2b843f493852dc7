"""A teacher read one decoder layer at a time (distill/streamed_teacher.py): the same top-k cache, key
and held-out perplexity as the loaded teacher, activations on disk when forced, a student derived from
the layers it keeps, the `distill` CLI end to end, and one-line refusals for what needs the whole teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import save_sharded
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from geminicompress.host import memory
from geminicompress.runtime import pipeline
from geminicompress.cli import app
from geminicompress.distill import streamed_teacher as ST
from geminicompress.distill.stage import _teacher_ppl
from geminicompress.distill.student import derive_student, student_from_config
from geminicompress.distill.topk_cache import build_topk_cache, cache_key
from geminicompress.models.lazy import LazyCheckpoint
from geminicompress.models.loading import load_model

CPU = torch.device("cpu")
K = 16
runner = CliRunner()
FAST = ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-every", "2", "--warmup-steps", "1", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def teacher_dir(request, tmp_path_factory) -> Path:
    return save_sharded(tmp_path_factory.mktemp("teacher") / "t", num_hidden_layers=4,  # a bf16 teacher in shards
                        tie_word_embeddings=request.param)


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 384, (9, 24), generator=torch.Generator().manual_seed(0))  # 6 train + 3 held out


def _separated(logits: torch.Tensor, k: int, eps: float = 1e-3) -> torch.Tensor:
    """(n, T, k) True where the rank-r logit is more than eps from its neighbours (its index is not tied)."""
    top = logits.float().topk(k + 1, dim=-1).values
    gap = top[..., :-1] - top[..., 1:]  # (n, T, k): rank r to r+1
    before = torch.cat([torch.full_like(gap[..., :1], float("inf")), gap[..., :-1]], dim=-1)
    return (gap > eps) & (before > eps)


def test_streamed_cache_key_and_ppl_equal_the_loaded_teacher(teacher_dir, windows, tmp_path):
    train, held = windows[:6], windows[6:]
    teacher = load_model(str(teacher_dir)).model
    loaded = build_topk_cache(teacher, train, K, CPU, root=tmp_path / "a")
    ckpt = LazyCheckpoint(teacher_dir)
    assert ST.lazy_key(ckpt, train, K) == cache_key(teacher, train, K)
    streamed, ppl = ST.build_streamed_topk_cache(ckpt, train, held, K, CPU, work_dir=tmp_path, root=tmp_path / "b")
    assert not streamed.reused and streamed.path.parent.name == loaded.path.parent.name
    assert streamed.values.dtype == torch.float16 and streamed.indices.dtype == torch.int32
    assert streamed.values.shape == loaded.values.shape == (6, 24, K)
    torch.testing.assert_close(streamed.values, loaded.values, rtol=1e-3, atol=1e-3)  # fp16 rounding at most
    with torch.no_grad():
        sure = _separated(teacher(train).logits, K)
    assert sure.float().mean() > 0.5
    assert torch.equal(streamed.indices[sure], loaded.indices[sure])
    assert ppl == pytest.approx(_teacher_ppl(teacher, held, CPU), rel=1e-5)
    assert all(p.is_meta for p in ckpt.model.parameters())  # nothing of the teacher stays in memory


def test_a_cache_from_either_path_is_reused_by_the_other(teacher_dir, windows, tmp_path, monkeypatch):
    train, held = windows[:6], windows[6:]
    teacher = load_model(str(teacher_dir)).model
    first = build_topk_cache(teacher, train, K, CPU, root=tmp_path)
    ckpt = LazyCheckpoint(teacher_dir)
    passes = []
    real = ST.topk_and_nll
    monkeypatch.setattr(ST, "topk_and_nll", lambda c, t, h, *a, **kw: passes.append((len(t), len(h))) or real(c, t, h, *a, **kw))
    again, ppl = ST.build_streamed_topk_cache(ckpt, train, held, K, CPU, work_dir=tmp_path, root=tmp_path)
    assert again.reused and torch.equal(again.values, first.values) and torch.equal(again.indices, first.indices)
    assert passes == [(0, 3)]  # the training windows were not run again: only the held-out ones
    third, ppl3 = ST.build_streamed_topk_cache(ckpt, train, held, K, CPU, work_dir=tmp_path, root=tmp_path)
    assert third.reused and ppl3 == ppl and passes == [(0, 3)]  # the held-out perplexity was stored too
    assert build_topk_cache(teacher, train, K, CPU, root=tmp_path).reused


def test_activations_spill_to_disk_when_they_do_not_fit(teacher_dir, windows, tmp_path, monkeypatch):
    train, held = windows[:6], windows[6:]
    ckpt = LazyCheckpoint(teacher_dir)
    expected, ppl = ST.build_streamed_topk_cache(ckpt, train, held, K, CPU, work_dir=tmp_path, root=tmp_path / "mem")
    monkeypatch.setattr(ST, "available_memory", lambda: 1000)  # two (9, 24, 64) float32 arrays do not fit
    seen = []
    real = ST.final_hidden

    def spy(*args, spill_dir=None, **kwargs):
        hidden = real(*args, spill_dir=spill_dir, **kwargs)
        seen.append(hidden.store.path)
        return hidden

    monkeypatch.setattr(ST, "final_hidden", spy)
    work = tmp_path / "work"
    work.mkdir()
    spilled, ppl2 = ST.build_streamed_topk_cache(ckpt, train, held, K, CPU, work_dir=work, root=tmp_path / "disk")
    assert len(seen) == 1 and seen[0] is not None and seen[0].parent == work / "teacher-activations"
    assert torch.equal(spilled.values, expected.values) and torch.equal(spilled.indices, expected.indices)
    assert ppl2 == ppl
    assert list(work.iterdir()) == []  # the activation files are gone


@pytest.mark.parametrize("how", ["layers", "config"])
def test_a_student_derived_from_the_streamed_teacher_reads_only_its_layers(teacher_dir, how, monkeypatch):
    teacher = load_model(str(teacher_dir)).model
    ckpt = LazyCheckpoint(teacher_dir)
    read = []
    real = ckpt.read
    monkeypatch.setattr(ckpt, "read", lambda names, dtype=None: read.extend(names) or real(names, dtype))
    if how == "layers":
        expected, kept = derive_student(teacher, [0, 3], 0.5)
        got, kept2 = derive_student(ckpt.model, [0, 3], 0.5, ckpt)
    else:
        config = teacher.config.__class__.from_dict({**teacher.config.to_dict(), "num_hidden_layers": 2,
                                                    "intermediate_size": 64})
        expected, kept = student_from_config(teacher, config)
        got, kept2 = student_from_config(ckpt.model, config, ckpt)
    assert kept == kept2 == [0, 3]
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    layers = {n.split(".")[2] for n in read if n.startswith("model.layers.")}
    assert layers == {"0", "3"}  # layers 1 and 2 were never read
    assert all(p.is_meta for p in ckpt.model.parameters())


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_distill_cli_with_a_streamed_teacher(teacher_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINICOMPRESS_CACHE", str(tmp_path / "cache"))
    loads = []
    real = pipeline.load_model
    monkeypatch.setattr(pipeline, "load_model", lambda spec, **kw: loads.append(spec) or real(spec, **kw))
    out = tmp_path / "student"
    res = _invoke("distill", "--teacher", teacher_dir, "--teacher-stream", "--topk-cache", K, "-o", out,
                  "--data", text_file, *FAST)
    assert res.exit_code == 0, res.output
    assert loads == []  # the teacher was never loaded whole
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    assert result["teacher_streamed"] and not result["topk_cache_reused"] and result["steps"] == 2
    assert result["kept_layers"] == [0, 3] and result["teacher_params"] > result["student_params"]
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
    # the same run with the teacher loaded whole reuses that cache and gives the same teacher perplexity
    out2 = tmp_path / "student2"
    res = _invoke("distill", "--teacher", teacher_dir, "--no-teacher-stream", "--topk-cache", K, "-o", out2,
                  "--data", text_file, "--derive", "even", "--repair", "none", *FAST)  # the streamed run's student
    assert res.exit_code == 0, res.output
    again = json.loads((out2 / "report.json").read_text())["stages"][0]["result"]
    assert again["topk_cache_reused"] and not again["teacher_streamed"] and again["topk_cache"] == result["topk_cache"]
    assert again["teacher_ppl"] == pytest.approx(result["teacher_ppl"], rel=1e-5)
    assert again["loss_curve"] == pytest.approx(result["loss_curve"], rel=1e-5)


def test_a_teacher_that_does_not_fit_streams_by_itself(teacher_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINICOMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(memory, "available_memory", lambda: 100_000)  # less than twice its float32 weights
    out = tmp_path / "o"
    res = _invoke("distill", "--teacher", teacher_dir, "--topk-cache", K, "-o", out, "--data", text_file, *FAST)
    assert res.exit_code == 0, res.output
    assert json.loads((out / "report.json").read_text())["stages"][0]["result"]["teacher_streamed"]
    # without --topk-cache it cannot stream: loaded whole as before, with a warning
    res = _invoke("distill", "--teacher", teacher_dir, "-o", tmp_path / "o2", "--data", text_file, *FAST)
    assert res.exit_code == 0, res.output
    assert "may not fit in memory, and it cannot be streamed" in res.output


def test_prune_then_distill_from_a_streamed_teacher_in_a_recipe(teacher_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINICOMPRESS_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""model: {teacher_dir}
stages:
  - {{type: prune, sparsity: 0.5}}
  - {{type: distill, data: {text_file}, teacher_stream: true, topk_cache: {K}, steps: 2, seq_len: 32, batch_size: 2,
      warmup_steps: 1}}
""")
    out = tmp_path / "out"
    res = _invoke("run", recipe, "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())["stages"][1]["result"]
    assert result["how"] == "previous stages' model" and result["teacher_streamed"] and result["sparsity"] > 0.4


@pytest.mark.parametrize("extra, message", [
    ([], "a streamed teacher teaches through its cached top-k logits: add --topk-cache K"),
    (["--topk-cache", "8", "--loss", "kl=1,hidden_mse=1"], "hidden-state losses need the teacher online"),  # any teacher
    (["--topk-cache", "8", "--student", "{teacher}", "--reconstruct"], "reconstruct refits to the whole teacher's layers"),
])
def test_what_needs_the_whole_teacher_is_refused_in_one_line(teacher_dir, text_file, tmp_path, extra, message):
    extra = [e.format(teacher=teacher_dir) for e in extra]
    out = tmp_path / "o"
    res = _invoke("distill", "--teacher", teacher_dir, "--teacher-stream", *extra, "-o", out, "--data", text_file, *FAST)
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and message in res.output
    assert not out.exists() and not list(tmp_path.glob(".o*"))


def test_a_teacher_that_is_not_a_dense_safetensors_dir_is_refused(teacher_dir, text_file, tmp_path):
    quantized = tmp_path / "q"
    quantized.mkdir()
    for f in teacher_dir.iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    res = _invoke("distill", "--teacher", quantized, "--teacher-stream", "--topk-cache", "8", "-o", tmp_path / "o",
                  "--data", text_file, *FAST)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "is not a local dense safetensors directory" in res.output
