"""`geminicompress distill` end to end on the tiny model, the stage's choice of teacher/student, the
top-k cache, and the speculative-decoding measurement."""

import json
from pathlib import Path

import pytest
import torch
from tiny import save_tiny, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.distill import stage as distill_stage
from geminicompress.distill.student import derive_student
from geminicompress.distill.topk_cache import build_topk_cache
from geminicompress.distill.train import Guides, TrainRun, train
from geminicompress.engine.contract import StageContext
from geminicompress.eval.speculative import measure_speculative
from geminicompress.formats.masks import MASKS_FILE, read_masks
from geminicompress.models.loading import load_model
from geminicompress.host.progress import NullProgress
from geminicompress.runtime.recipes.schema import Recipe
import stage_for_tests

runner = CliRunner()
CPU = torch.device("cpu")
FAST = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--eval-every", "2", "--warmup-steps", "1", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("teacher") / "t4", num_hidden_layers=4)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_distill_cli_writes_a_half_depth_student(teacher_dir, text_file, tmp_path):
    out = tmp_path / "student"
    res = invoke("distill", "--teacher", teacher_dir, "-o", out, "--data", text_file, *FAST)
    assert res.exit_code == 0, res.output
    student = AutoModelForCausalLM.from_pretrained(out)
    assert student.config.num_hidden_layers == 2
    report = json.loads((out / "report.json").read_text())
    result = report["stages"][0]["result"]
    assert result["kept_layers"] == [0, 3] and result["steps"] == 3 and result["tokens"] == 3 * 2 * 32
    assert [p[0] for p in result["ppl_curve"]] == [0, 2, 3]
    assert len(result["loss_curve"]) == 3 and result["tokens_per_s"] > 0
    assert (out / "distill_curve.png").stat().st_size > 1000
    # the tiny teacher's head is untied: the student's input embedding stayed the teacher's own (shared_embedding.py)
    assert result["embedding"] == "frozen, the teacher's"
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    assert torch.equal(student.get_input_embeddings().weight, teacher.get_input_embeddings().weight)


def test_layer_list_out_of_range_is_one_line(teacher_dir, text_file, tmp_path):
    res = invoke("distill", "--teacher", teacher_dir, "-o", tmp_path / "o", "--data", text_file,
                 "--student-layers", "0,7", *FAST)
    assert res.exit_code == 2
    assert "layer 7 is out of range for a teacher with 4 layers" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_mismatched_tokenizers_are_one_line(teacher_dir, text_file, tmp_path):
    other = tmp_path / "other"
    tiny_model(num_hidden_layers=1).save_pretrained(other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<zzz>"])
    tok.save_pretrained(other)
    res = invoke("distill", "--teacher", teacher_dir, "--student", other, "-o", tmp_path / "o", "--data", text_file, *FAST)
    assert res.exit_code == 2
    assert "different tokenizer from the teacher's" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_student_not_smaller_is_allowed_with_a_warning(teacher_dir, text_file, tmp_path):
    res = runner.invoke(app, ["distill", "--teacher", str(teacher_dir), "-o", str(tmp_path / "o"), "--data",
                              str(text_file), "--student", str(teacher_dir), *FAST])
    assert res.exit_code == 0, res.output
    assert "not smaller than the teacher" in res.output


def _ctx(recipe, model, tok, tmp_path, masks=None):
    source = load_model(recipe.model).source
    return StageContext(model, tok, source, recipe, NullProgress(), CPU, tmp_path, tmp_path, masks=masks)


def test_after_a_prune_stage_the_pipeline_model_is_the_student(teacher_dir, text_file, tmp_path):
    recipe = Recipe.model_validate({"model": str(teacher_dir), "stages": [
        {"type": "prune", "sparsity": 0.5},
        {"type": "distill", "data": str(text_file), "steps": 3, "seq_len": 32, "batch_size": 2, "warmup_steps": 1}]})
    pruned = load_model(str(teacher_dir)).model
    masks = {}
    with torch.no_grad():
        for name, p in pruned.named_parameters():
            if "layers" in name and p.dim() == 2:
                masks[name] = torch.rand_like(p) > 0.5
                p.mul_(masks[name])
    ctx = _ctx(recipe, pruned, tiny_tokenizer(), tmp_path, masks)
    summary = distill_stage.run(recipe.stages[1], ctx)
    assert summary["how"] == "previous stages' model" and summary["student_layers"] == 4
    assert ctx.model is pruned
    params = dict(ctx.model.named_parameters())
    assert all(torch.all(params[n][~m] == 0) for n, m in masks.items())
    assert summary["sparsity"] == pytest.approx(sum(int((~m).sum()) for m in masks.values())
                                                / sum(m.numel() for m in masks.values()))
    back = read_masks(tmp_path)
    assert (tmp_path / MASKS_FILE).is_file() and all(torch.equal(back[n], m) for n, m in masks.items())


def test_first_stage_without_student_derives_half(teacher_dir, text_file, tmp_path):
    recipe = Recipe.model_validate({"model": str(teacher_dir), "stages": [
        {"type": "distill", "data": str(text_file), "steps": 2, "seq_len": 32, "batch_size": 2}]})
    loaded = load_model(str(teacher_dir))
    ctx = _ctx(recipe, loaded.model, loaded.tokenizer, tmp_path)
    summary = distill_stage.run(recipe.stages[0], ctx)
    assert summary["kept_layers"] == [0, 3] and ctx.model.config.num_hidden_layers == 2


def test_topk_cache_is_reused_and_matches_online_kl_when_k_is_the_vocabulary(tmp_path):
    from geminicompress.distill.config import DistillStage

    teacher = tiny_model(num_hidden_layers=2)
    w = torch.randint(0, 384, (10, 16), generator=torch.Generator().manual_seed(0))
    first = build_topk_cache(teacher, w[:8], 384, CPU, root=tmp_path)
    again = build_topk_cache(teacher, w[:8], 384, CPU, root=tmp_path)
    assert not first.reused and again.reused and torch.equal(first.indices, again.indices)
    cfg = DistillStage(type="distill", steps=3, seq_len=16, batch_size=2, warmup_steps=1, eval_windows=2)
    runs = []
    for cache in (None, again):
        student, _ = derive_student(teacher, 0.5)
        _, h = train(student, teacher, w[:8], w[8:], cfg, TrainRun(0, tmp_path / str(len(runs)), CPU),
                     Guides(cache=cache))
        runs.append(h.loss)
    # fp16 storage of the cached logits is the only difference
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=2e-3, atol=1e-3)


def test_speculative_measurement_counts_acceptance():
    teacher = tiny_model(num_hidden_layers=4)
    same, _ = derive_student(teacher, 1.0)
    prompt = torch.randint(1, 384, (1, 6), generator=torch.Generator().manual_seed(0))
    r = measure_speculative(teacher, same, tiny_tokenizer(), prompt, gen_len=12, repeats=1, warmup=0)
    assert r["acceptance_rate"] == 1.0 and r["same_output"]
    assert r["teacher_tokens_per_s"] > 0 and r["speedup"] == pytest.approx(
        r["assisted_tokens_per_s"] / r["teacher_tokens_per_s"])
    half, _ = derive_student(teacher, 0.5)
    r = measure_speculative(teacher, half, tiny_tokenizer(), prompt, gen_len=12, repeats=1, warmup=0)
    assert 0.0 <= r["acceptance_rate"] < 1.0 and r["same_output"] and r["proposed_tokens"] > 0


def test_helper_ranks_of_a_multi_process_launch_write_nothing(tiny_dir, tmp_path, monkeypatch):
    from geminicompress.runtime import methods

    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(stage_for_tests.zero_first_layer))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = invoke("prune", tiny_dir, "-o", tmp_path / "out", "--quiet")
    assert res.exit_code == 0, res.output
    assert list(tmp_path.iterdir()) == []  # rank 0 writes OUT; rank 1 leaves no trace


def test_reconstruct_refits_a_pruned_student_before_training(teacher_dir, text_file, tmp_path):
    pruned = tmp_path / "pruned"
    res = invoke("prune", teacher_dir, "-o", pruned, "--sparsity", "0.5", "--quiet")
    assert res.exit_code == 0, res.output
    masks = read_masks(pruned)
    out = tmp_path / "recovered"
    res = invoke("distill", "--teacher", teacher_dir, "--student", pruned, "--reconstruct", "--samples", "6",
                 "-o", out, "--data", text_file, *FAST)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    rebuilt = result["reconstruct"]
    assert rebuilt["windows"] == 6 and len(rebuilt["layers"]) == 4
    assert all(row["error_after"] < row["error_before"] for row in rebuilt["layers"])
    params = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    assert all(torch.all(params[n][~m] == 0) for n, m in masks.items())


def test_reconstruct_needs_a_pruned_copy_of_the_teacher(teacher_dir, text_file, tmp_path):
    res = invoke("distill", "--teacher", teacher_dir, "--student-layers", "0.5", "--reconstruct", "-o",
                 tmp_path / "a", "--data", text_file, *FAST)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "reconstruct needs a student with the teacher's layers" in res.output
    res = invoke("distill", "--teacher", teacher_dir, "--student", teacher_dir, "--reconstruct", "-o",
                 tmp_path / "b", "--data", text_file, *FAST)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "this student has no masks and no pruned zeros" in res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_prune_then_distill_with_reconstruct_in_a_recipe(teacher_dir, text_file, tmp_path):
    recipe = tmp_path / "recover.yaml"
    recipe.write_text(f"""model: {teacher_dir}
calibration: {{data: {text_file}, samples: 4, seq_len: 32}}
stages:
  - {{type: prune, sparsity: 0.5}}
  - {{type: distill, data: {text_file}, reconstruct: true, steps: 2, seq_len: 32, batch_size: 2, warmup_steps: 1}}
""")
    out = tmp_path / "out"
    res = invoke("run", recipe, "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    stages = json.loads((out / "report.json").read_text())["stages"]
    rebuilt = stages[1]["result"]["reconstruct"]
    assert rebuilt["windows"] == 4 and rebuilt["seq_len"] == 32
    assert all(row["error_after"] < row["error_before"] for row in rebuilt["layers"])
    masks = read_masks(out)
    params = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    assert masks and all(torch.all(params[n][~m] == 0) for n, m in masks.items())


def test_restyle_changes_the_training_text_not_the_held_out_windows(teacher_dir, text_file, tmp_path):
    results = []
    for name, extra in (("plain", []), ("styled", ["--restyle", "1.0"])):
        res = invoke("distill", "--teacher", teacher_dir, "-o", tmp_path / name, "--data", text_file, *FAST, *extra)
        assert res.exit_code == 0, res.output
        results.append(json.loads((tmp_path / name / "report.json").read_text())["stages"][0]["result"])
    plain, styled = results
    assert styled["ppl_curve"][0] == plain["ppl_curve"][0]  # the same student scored on the same held-out windows
    assert styled["loss_curve"][0] != plain["loss_curve"][0]  # trained on other text
    res = invoke("distill", "--teacher", teacher_dir, "-o", tmp_path / "bad", "--data", text_file, *FAST,
                 "--restyle", "1.5")
    assert res.exit_code == 2 and "restyle" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "bad").exists()
