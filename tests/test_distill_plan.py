"""Choosing a cut by measurement and repairing it in closed form (distill/survey, plan, repair, cut)."""

import json

import pytest
import torch
from tiny import tiny_model

from geminicompress.core.arch import decoder_layers
from geminicompress.distill.cut import cut_student
from geminicompress.distill.plan import block_params, candidates, make_plan
from geminicompress.distill.repair import LeastSquares, RepairSpec, boundaries_read, merge_map, refit_block, repair
from geminicompress.distill.student import check_student_layers, derive_student, keep_count, keep_layers
from geminicompress.distill.survey import angular_distance, run_layers, walk
from geminicompress.core.errors import InputError

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    teacher = tiny_model(num_hidden_layers=8)
    # ids from a 48-token slice of the vocabulary, so that held-out windows look like the fit ones (a random
    # model over all 384 tokens has nothing a fit on 1,024 tokens could carry over to other windows)
    windows = torch.randint(0, 48, (40, 32), generator=torch.Generator().manual_seed(1))
    full = walk(teacher, windows, device=CPU)
    return teacher, windows, full.rows(0, 32), full.rows(32, 40)  # fit on 32 windows, 8 held out


def _final_error(student, teacher_final, walk_, kept):
    """Relative error of the student's last hidden state (before the final norm) vs the teacher's."""
    out = run_layers(list(decoder_layers(student)), walk_.hidden[0], walk_.kwargs, device=CPU)
    return float((out - teacher_final).norm() / teacher_final.norm())


def test_least_squares_recovers_a_known_map():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(400, 6, generator=g), torch.randn(6, 3, generator=g)
    ls = LeastSquares(6, 3)
    ls.add_batch(x[:200], x[:200] @ w)
    ls.add_batch(x[200:], x[200:] @ w)
    assert torch.allclose(ls.solve(1e-9), w, atol=1e-5)
    # a large ridge pulls towards the prior
    assert torch.allclose(ls.solve(1e6, prior=torch.zeros(6, 3)), torch.zeros(6, 3), atol=1e-3)


def test_merged_down_proj_equals_applying_the_map():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=True)
    t = torch.randn(8, 8, generator=g)
    a = torch.randn(5, 16, generator=g)
    w, b = merge_map(lin.weight.detach(), lin.bias.detach(), t)
    assert torch.allclose(a @ w.T + b, lin(a).detach() @ t, atol=1e-5)


def test_walk_boundaries_are_the_model_hidden_states(setup):
    teacher, windows, fit, _ = setup
    ref = teacher(windows[:32], output_hidden_states=True).hidden_states
    assert len(fit.hidden) == 9 and fit.hidden[0].shape == (32, 32, 64)
    for i in range(8):  # transformers' last entry is after the final norm; ours before it
        assert torch.allclose(fit.hidden[i], ref[i], atol=1e-5)
    assert fit.channels.shape == (8, 128) and fit.heads.shape == (8, 4) and bool((fit.channels > 0).all())
    assert angular_distance(fit.hidden[3], fit.hidden[3]) < 1e-6


def test_without_follow_only_the_blocks_before_a_cut_are_refit(setup):
    teacher, _, fit, held = setup
    kept = [0, 2, 3, 5, 6, 7]  # two dropped runs: blocks 0 and 3 carry the maps
    dropped, _ = derive_student(teacher, kept)
    repaired, rows = cut_student(teacher, kept, fit, RepairSpec("down_proj"))
    assert [r["teacher_layer"] for r in rows] == [0, 3] and all(r["error_after"] < r["error_before"] for r in rows)
    for w in (fit, held):
        assert _final_error(repaired, w.hidden[-1], w, kept) < _final_error(dropped, w.hidden[-1], w, kept)


@pytest.mark.parametrize("spec, ratio", [(RepairSpec("down_proj"), 1.0), (RepairSpec("linear"), 1.0),
                                         (RepairSpec("down_proj", follow=True), 1.0), (RepairSpec("none"), 0.5)])
@pytest.mark.parametrize("kept", [[0, 1, 4, 5, 6, 7], [0, 2, 3, 5, 6, 7], [2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5]])
def test_the_repair_reads_only_the_boundaries_it_names(setup, spec, ratio, kept):
    """A walk holding only `boundaries_read` repairs a cut to the same weights as the whole walk (the plan
    releases the rest: the demo's walk is 1.2 GiB)."""
    teacher, _, fit, _ = setup
    narrowed = ratio < 1.0
    read = boundaries_read(kept, 8, spec, narrowed)
    only = fit.rows(0, 32)
    only.keep_only(read)
    assert sum(h is not None for h in only.hidden) == len(read) and all(h is not None for h in fit.hidden)
    out = []
    for w in (fit, only):
        student, _ = derive_student(teacher, kept, ratio)
        rows = repair(list(decoder_layers(student)), kept, w, "mlp.down_proj", spec, narrowed=narrowed)
        out.append((rows, student.state_dict()))
    assert out[0][0] == out[1][0] and all(torch.equal(v, out[1][1][k]) for k, v in out[0][1].items())
    if spec == RepairSpec("down_proj") and kept == [0, 1, 4, 5, 6, 7]:
        assert read == {1, 4}  # the one refit block's input and target, of 9 boundaries
    if kept == [0, 1, 2, 3, 4, 5] and not narrowed:
        assert read == {5, 8}  # the last block refit towards the teacher's last boundary


@pytest.mark.parametrize("mode", ["down_proj", "linear"])
@pytest.mark.parametrize("kept", [[0, 1, 4, 5, 6, 7], [0, 2, 3, 5, 6, 7]])  # a span; a non-contiguous set
def test_repair_reduces_hidden_state_error_vs_drop_only(setup, mode, kept):
    teacher, windows, fit, held = setup
    dropped, _ = derive_student(teacher, kept)
    repaired, rows = cut_student(teacher, kept, fit, RepairSpec(mode, follow=True))
    assert rows and all(r["error_after"] < r["error_before"] for r in rows)
    before = _final_error(dropped, fit.hidden[-1], fit, kept)
    after = _final_error(repaired, fit.hidden[-1], fit, kept)
    assert after < 0.4 * before, (mode, before, after)  # measured ~0.25-0.3 of it
    before = _final_error(dropped, held.hidden[-1], held, kept)  # windows the fit never saw
    after = _final_error(repaired, held.hidden[-1], held, kept)
    assert after < 0.9 * before, (mode, before, after)  # measured ~0.8 of it


def test_down_proj_refit_is_at_least_as_good_as_the_linear_map(setup):
    teacher, _, fit, _ = setup
    kept = [0, 1, 4, 5, 6, 7]
    errs = {}
    for mode in ("linear", "down_proj"):
        layer = __import__("copy").deepcopy(decoder_layers(teacher)[1])
        _, err = refit_block(layer, "mlp.down_proj", fit.hidden[1], fit.hidden[4], fit.kwargs, RepairSpec(mode, ridge=1e-6),
                             device=CPU)
        errs[mode] = err["error_after"]
        assert err["error_after"] < err["error_before"]
    assert errs["down_proj"] <= errs["linear"] + 1e-4, errs


def test_cosine_objective_raises_cosine_similarity(setup):
    teacher, _, fit, _ = setup
    import copy

    cos = {}
    for objective in ("mse", "cosine"):
        layer = copy.deepcopy(decoder_layers(teacher)[1])
        out, _ = refit_block(layer, "mlp.down_proj", fit.hidden[1], fit.hidden[4], fit.kwargs,
                             RepairSpec("linear", objective, cosine_steps=30), device=CPU)
        cos[objective] = float(torch.nn.functional.cosine_similarity(out, fit.hidden[4], dim=-1).mean())
    assert cos["cosine"] > cos["mse"], cos


def test_narrow_mlp_by_importance_with_refit_beats_weight_norm(setup):
    teacher, _, fit, held = setup
    kept = list(range(8))
    by_norm, _ = derive_student(teacher, kept, 0.5)
    refit, rows = cut_student(teacher, kept, fit, RepairSpec("none"), mlp_ratio=0.5)
    assert refit.config.intermediate_size == 64 and len(rows) == 8
    assert _final_error(refit, held.hidden[-1], held, kept) < _final_error(by_norm, held.hidden[-1], held, kept)


def test_cut_checkpoint_reloads_in_transformers_with_identical_outputs(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    teacher, windows, fit, _ = setup
    student, _ = cut_student(teacher, [0, 1, 2, 5, 6, 7], fit, RepairSpec("down_proj"))
    student.save_pretrained(tmp_path / "s")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "s").eval()
    assert back.config.num_hidden_layers == 6 and back.config.model_type == teacher.config.model_type
    with torch.no_grad():
        assert torch.equal(back(windows[:2]).logits, student(windows[:2]).logits)


def test_plan_candidates_and_fields(setup):
    teacher, windows, fit, held = setup
    cands = candidates(fit, 6, block_params(decoder_layers(teacher)))
    spans = [c for c in cands if c.kind == "span"]
    assert [c.dropped for c in spans] == [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]  # first and last kept
    assert {c.kind for c in cands} <= {"span", "angular-set", "even"} and any(c.kind == "even" for c in cands)
    plan = make_plan(teacher, 6, fit.rows(0, 32), held, windows[32:], RepairSpec("down_proj"), shortlist=2)
    d = json.loads(json.dumps(plan.as_dict()))
    assert {"n_layers", "keep", "teacher_ppl", "chosen", "predicted_drift", "candidates", "repair", "decode"} <= set(d)
    for c in d["candidates"]:
        assert {"dropped", "kept", "kind", "angular", "params_saved", "drift", "repaired_drift"} <= set(c)
        assert len(c["kept"]) == 6 and c["params_saved"] == 2 * block_params(decoder_layers(teacher))[0]
    shortlisted = [c for c in d["candidates"] if c["repaired_drift"] is not None]
    assert len(shortlisted) == 2
    assert d["chosen"]["repaired_drift"] == min(c["repaired_drift"] for c in shortlisted) == d["predicted_drift"]
    # a candidate's repaired drift is that of the student cut_student builds with the map at each cut only
    student, _ = cut_student(teacher, d["chosen"]["kept"], fit, RepairSpec("down_proj"))
    from geminicompress.eval.quality.perplexity import perplexity

    measured = perplexity(student, windows[32:]) / perplexity(teacher, windows[32:]) - 1
    assert measured == pytest.approx(d["predicted_drift"], abs=1e-4)


def test_layer_counts_refused_in_one_line():
    assert keep_count(30, 24) == 24 and keep_count(30, 0.8) == 24 and len(keep_layers(30, 24)) == 24
    assert check_student_layers(30, 24) == keep_layers(30, 24)
    for bad in (31, 0):
        with pytest.raises(InputError, match="keeps 1 .. 29 layers") as e:
            check_student_layers(30, bad)
        assert "\n" not in str(e.value)
    # every layer and every MLP channel: a copy of the teacher, however it is said
    for same in (30, 1.0, 0.99, list(range(30))):
        with pytest.raises(InputError, match="keeps all 30 layers and every MLP channel") as e:
            check_student_layers(30, same)
        assert "\n" not in str(e.value) and "copy of the teacher" in str(e.value)
    # a narrower student may keep every layer (a width cut), never more
    for same in (30, 1.0, list(range(30))):
        assert check_student_layers(30, same, mlp_ratio=0.75) == list(range(30))
    with pytest.raises(InputError, match="keeps 1 .. 30 layers"):
        check_student_layers(30, 31, mlp_ratio=0.75)


# --------------------------------------------------------------------------- the command


def _invoke(*args):
    from typer.testing import CliRunner

    from geminicompress.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _forbid_loading(monkeypatch) -> None:
    """Fail the test if a model loads: the loader patched where it is defined and where the pipeline holds it
    (imported first, so that it does not keep the patched one after the test)."""
    from geminicompress.runtime import pipeline
    from geminicompress.models import loading

    for module in (loading, pipeline):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded the teacher"))


@pytest.fixture(scope="module")
def teacher6(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("teacher") / "t6", num_hidden_layers=6)


def test_distill_train_minutes_0_stops_after_the_repair_and_writes_the_plan(teacher6, text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "student"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "4", "--train-minutes", "0", "--data", text_file,
                  "--quiet", "-o", out)
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["derive"] == "measured" and plan["keep"] == 4 and len(plan["kept"]) == 4
    assert plan["chosen"]["kept"] == plan["kept"] and plan["repair"]["mode"] == "down_proj"
    assert plan["predicted_drift"] == pytest.approx(plan["student_drift"], abs=1e-4)
    assert {"teacher_ms_per_token", "student_ms_per_token"} <= set(plan["decode"])
    student = AutoModelForCausalLM.from_pretrained(out)
    assert student.config.num_hidden_layers == 4
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    assert result["steps"] == 0 and result["kept_layers"] == plan["kept"]


def test_distill_even_without_repair_is_the_old_derivation(teacher6, text_file, tmp_path):
    out = tmp_path / "even"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "0.5", "--derive", "even", "--repair", "none",
                  "--train-tokens", "0", "--data", text_file, "--quiet", "-o", out)
    assert res.exit_code == 0, res.output
    assert not (out / "plan.json").exists()
    result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
    assert result["kept_layers"] == keep_layers(6, 0.5)


@pytest.mark.parametrize("layers, says", [("6", "copy of the teacher"), ("1.0", "copy of the teacher"),
                                          ("0,1,2,3,4,5", "copy of the teacher"), ("7", "keeps 1 .. 5 layers"),
                                          ("0", "keeps 1 .. 5 layers"), ("0,6", "out of range")])
def test_distill_refuses_a_layer_count_before_loading(teacher6, text_file, tmp_path, monkeypatch, layers, says):
    _forbid_loading(monkeypatch)
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", layers, "--data", text_file, "-o", tmp_path / "x")
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_a_cut_student_loaded_again_keeps_its_layers_and_their_map(teacher6, text_file, tmp_path):
    """distill --student DIR on a student distill cut: report.json's kept_layers are carried (so hidden-state
    losses use the derived map, boundary_mapped, not evenly spaced targets), through a second generation too."""
    from geminicompress.distill.student import boundary_mapped, evenly_mapped

    cut, again, third = tmp_path / "cut", tmp_path / "again", tmp_path / "third"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "0,1,4,5", "--train-minutes", "0", "--data",
                  text_file, "--quiet", "-o", cut)
    assert res.exit_code == 0, res.output
    for src, out in ((cut, again), (again, third)):
        before = (src / "model.safetensors").read_bytes()
        res = _invoke("distill", "--teacher", teacher6, "--student", src, "--steps", "1", "--loss", "kl=1,hidden_mse=1",
                      "--seq-len", "32", "--batch-size", "1", "--data", text_file, "--quiet", "-o", out)
        assert res.exit_code == 0, res.output
        result = json.loads((out / "report.json").read_text())["stages"][0]["result"]
        assert result["kept_layers"] == [0, 1, 4, 5]
        assert result["how"] == f"the student loaded from {src}"  # it said "into DIR", as if DIR were written
        assert (src / "model.safetensors").read_bytes() == before  # and it is not
        assert {int(k): v for k, v in result["layer_map"].items()} == boundary_mapped([0, 1, 4, 5], 6) == {0: 0, 1: 3, 2: 4, 3: 5}
    assert boundary_mapped([0, 1, 4, 5], 6) != evenly_mapped(4, 6)
    # a report made with another teacher is not trusted: evenly spaced targets, as for any loaded student
    report = json.loads((cut / "report.json").read_text())
    report["stages"][0]["result"]["teacher_params"] += 1
    (cut / "report.json").write_text(json.dumps(report))
    res = _invoke("distill", "--teacher", teacher6, "--student", cut, "--steps", "1", "--loss", "kl=1,hidden_mse=1",
                  "--seq-len", "32", "--batch-size", "1", "--data", text_file, "--quiet", "-o", tmp_path / "other")
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "other" / "report.json").read_text())["stages"][0]["result"]
    assert result["kept_layers"] is None
    assert {int(k): v for k, v in result["layer_map"].items()} == evenly_mapped(4, 6)


def test_a_recipe_asking_for_a_copy_of_the_teacher_is_refused(teacher6, text_file, tmp_path):
    recipe = tmp_path / "copy.yaml"
    recipe.write_text(f"model: {teacher6}\nstages:\n  - type: distill\n    student_layers: 6\n    data: {text_file}\n")
    res = _invoke("run", recipe, "-o", tmp_path / "out")
    assert res.exit_code == 2 and "copy of the teacher" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))  # no partial folder either


def test_a_width_cut_keeps_every_layer_and_narrows_the_mlps(teacher6, text_file, tmp_path):
    """--student-layers 1.0 with --mlp-ratio < 1: every block kept, MLP channels by activation importance,
    each down projection refit; the student is narrower, not a copy."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "wide"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "1.0", "--mlp-ratio", "0.5", "--train-minutes",
                  "0", "--data", text_file, "--quiet", "-o", out)
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kept"] == list(range(6)) and plan["dropped"] == [] and plan["mlp_ratio"] == 0.5
    teacher = AutoModelForCausalLM.from_pretrained(teacher6)
    student = AutoModelForCausalLM.from_pretrained(out)
    assert student.config.num_hidden_layers == 6
    assert student.config.intermediate_size == round(teacher.config.intermediate_size * 0.5)
    assert plan["params_student"] < plan["params_teacher"]
    # the down projections were refit, so they are not the teacher's columns copied
    down_s = student.model.layers[0].mlp.down_proj.weight
    assert down_s.shape == (teacher.config.hidden_size, student.config.intermediate_size)
    assert not any(torch.equal(down_s[:, :1], teacher.model.layers[0].mlp.down_proj.weight[:, i:i + 1])
                   for i in range(teacher.config.intermediate_size))


def test_distill_refuses_an_unmappable_architecture_before_loading(tmp_path, text_file):
    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "config.json").write_text(json.dumps({"model_type": "not_a_model", "num_hidden_layers": 4}))
    res = _invoke("distill", "--teacher", weird, "--student-layers", "3", "--data", text_file, "-o", tmp_path / "x")
    assert res.exit_code == 2 and "no block map" in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_two_budgets_are_refused():
    from pydantic import ValidationError

    from geminicompress.distill.config import DistillStage

    with pytest.raises(ValidationError, match="one training budget"):
        DistillStage(type="distill", train_minutes=1, train_tokens=100)
    with pytest.raises(ValidationError, match="one training budget"):
        DistillStage(type="distill", steps=5, train_minutes=1)
    assert not DistillStage(type="distill", train_minutes=0).trains and DistillStage(type="distill").trains


def test_train_minutes_trains_until_the_budget_is_spent(tmp_path):
    from geminicompress.distill.train import TrainRun, train
    from geminicompress.distill.config import DistillStage

    teacher = tiny_model(num_hidden_layers=4)
    student, _ = derive_student(teacher, [0, 3])
    windows = torch.randint(0, 384, (10, 16), generator=torch.Generator().manual_seed(0))
    cfg = DistillStage(type="distill", train_minutes=0.003, seq_len=16, batch_size=2, warmup_steps=1,
                       eval_every=10_000, eval_windows=2)
    _, hist = train(student, teacher, windows[:8], windows[8:], cfg, TrainRun(0, tmp_path, CPU))
    assert hist.step >= 1 and hist.seconds >= 0.18  # stopped only once 0.003 minutes of steps were spent
    assert hist.tokens == hist.step * 2 * 16 and len(hist.ppl) == 2  # before, and at the last step


# --------------------------------------------------------------------------- --target-latency


def test_latency_target_is_the_parameter_share_read_per_token():
    from geminicompress.distill.latency_target import keep_for_latency, read_shares
    from geminicompress.distill.config import parse_latency

    teacher = tiny_model(num_hidden_layers=6)
    head, block, n = read_shares(teacher)
    assert (head, block, n) == (384 * 64, 36992.0, 6)  # the head (vocab x hidden); a block's mean parameters
    total = head + n * block
    assert keep_for_latency(teacher, 0.9) == (5, round((head + 5 * block) / total, 4))  # 5 blocks: 0.85x
    assert keep_for_latency(teacher, 0.5)[0] == 2  # 3 blocks would read 0.55x
    assert parse_latency("0.8x") == parse_latency(" 0.8 ") == 0.8
    with pytest.raises(InputError, match=r"even a 1-layer student reads 0.25x .* ask for at least 0.25x") as e:
        keep_for_latency(teacher, 0.1)
    assert "\n" not in str(e.value)
    for bad in ("1x", "1.5x", "0x", "fast", "nan"):
        with pytest.raises(ValueError, match="target_latency"):
            parse_latency(bad)


@pytest.mark.parametrize("target, says", [("0.1x", "ask for at least 0.25x"), ("1.2x", "decode faster than its teacher"),
                                          ("quick", "give a fraction")])
def test_distill_refuses_a_latency_target_before_loading(teacher6, text_file, tmp_path, monkeypatch, target, says):
    _forbid_loading(monkeypatch)
    res = _invoke("distill", "--teacher", teacher6, "--target-latency", target, "--data", text_file, "-o", tmp_path / "x")
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_distill_target_latency_chooses_the_layer_count(teacher6, text_file, tmp_path):
    out = tmp_path / "fast"
    res = _invoke("distill", "--teacher", teacher6, "--target-latency", "0.5x", "--train-minutes", "0", "--data",
                  text_file, "--quiet", "-o", out)
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["keep"] == 2 and len(plan["kept"]) == 2
    assert plan["target_latency"] == {"target": 0.5, "keep": 2, "predicted_ratio": 0.3998, "basis": "parameter share"}
    res = _invoke("distill", "--teacher", teacher6, "--target-latency", "0.5x", "--student-layers", "3", "--data",
                  text_file, "-o", tmp_path / "both")
    assert res.exit_code == 2 and "give one of" in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_plan_data_gives_the_held_out_windows(teacher6, text_file, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed(text_file.read_text().split())))  # the same words, another text
    plans = []
    for extra in ([], ["--plan-data", other]):
        out = tmp_path / f"held{len(extra)}"
        res = _invoke("distill", "--teacher", teacher6, "--student-layers", "4", "--train-minutes", "0", "--data",
                      text_file, *extra, "--quiet", "-o", out)
        assert res.exit_code == 0, res.output
        plans.append(json.loads((out / "plan.json").read_text()))
    assert plans[0]["held_data"] == str(text_file) and plans[1]["held_data"] == str(other)
    assert plans[1]["teacher_ppl"] != pytest.approx(plans[0]["teacher_ppl"], rel=1e-3)  # other windows
    assert plans[1]["predicted_drift"] == pytest.approx(plans[1]["student_drift"], abs=1e-4)


def test_weighted_least_squares_is_the_fit_on_scaled_rows():
    from geminicompress.distill.repair import token_weights

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 10, 6, generator=g), torch.randn(3, 10, 4, generator=g)
    w = torch.rand(3, 10, generator=g) + 0.1
    ls = LeastSquares(6, 4)
    ls.add_batch(x, y, w)
    ref = torch.linalg.lstsq((x * w[..., None].sqrt()).reshape(-1, 6).double(),
                             (y * w[..., None].sqrt()).reshape(-1, 4).double()).solution.float()
    assert torch.allclose(ls.solve(0.0), ref, atol=1e-4)
    # skip_first: the fit on every position but 0
    skip = token_weights(y, "skip_first")
    assert skip[:, 0].eq(0).all() and skip[:, 1:].eq(1).all()
    ls0, ls1 = LeastSquares(6, 4), LeastSquares(6, 4)
    ls0.add_batch(x, y, skip)
    ls1.add_batch(x[:, 1:], y[:, 1:])
    assert torch.allclose(ls0.solve(0.1), ls1.solve(0.1), atol=1e-5)
    # inverse_norm: 1 / ||target||^2 per token, mean 1
    inv = token_weights(y, "inverse_norm")
    by_hand = 1 / y.pow(2).sum(-1)
    assert torch.allclose(inv, by_hand / by_hand.mean(), rtol=1e-5) and token_weights(y, "uniform") is None


def test_weighting_changes_the_repair_and_shrinks_the_weighted_error(setup):
    import copy

    from geminicompress.distill.repair import token_weights

    teacher, _, fit, _ = setup
    target = fit.hidden[4]
    w = token_weights(target, "inverse_norm")
    outs = {}
    for weighting in ("uniform", "inverse_norm"):
        layer = copy.deepcopy(decoder_layers(teacher)[1])
        outs[weighting], _ = refit_block(layer, "mlp.down_proj", fit.hidden[1], target, fit.kwargs,
                                         RepairSpec("down_proj", ridge=1e-6, weighting=weighting), device=CPU)
    werr = {k: float((w[..., None] * (o - target).pow(2)).sum()) for k, o in outs.items()}
    err = {k: float((o - target).pow(2).sum()) for k, o in outs.items()}
    assert not torch.allclose(outs["uniform"], outs["inverse_norm"])
    assert werr["inverse_norm"] < werr["uniform"] and err["uniform"] < err["inverse_norm"], (werr, err)


def _with_identity_blocks(blocks):
    """The tiny teacher (8 blocks) with `blocks` made identities (their attention and MLP write nothing), its
    head sharpened, and 12 windows of its own greedy text: on them it is near-certain, so that removing any
    block that writes something raises the windows' perplexity (a random model's text would not)."""
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=8).eval()
    for b in blocks:
        layer = decoder_layers(model)[b]
        layer.self_attn.o_proj.weight.data.zero_()
        layer.mlp.down_proj.weight.data.zero_()
    model.lm_head.weight.data.mul_(20.0)
    ids = torch.randint(0, 384, (12, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(15):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return model, ids


def test_greedy_cut_removes_the_blocks_that_cost_nothing():
    from geminicompress.distill.greedy import greedy_cut

    model, windows = _with_identity_blocks([2, 5])
    full = walk(model, windows, device=CPU)
    fit, held = full.rows(0, 8), full.rows(8, 12)
    steps = greedy_cut(model, 6, fit, held, windows[8:], RepairSpec("down_proj"))
    assert {s.block for s in steps} == {2, 5} and steps[-1].dropped == [2, 5]
    assert all(abs(s.drift) < 1e-4 for s in steps)  # removing an identity block changes nothing
    assert all(d > 1e-2 for b, d in steps[0].tried.items() if b not in (2, 5)), steps[0].tried  # the others cost
    assert set(steps[0].tried) == set(range(1, 7))  # first and last kept
    # a pool of 2: after the first step only the best candidates of the step before are tried
    pooled = greedy_cut(model, 5, fit, held, windows[8:], RepairSpec("down_proj"), pool=2)
    assert [len(s.tried) for s in pooled] == [6, 2, 2] and pooled[1].dropped == [2, 5]


def test_greedy_set_joins_the_plan_and_is_chosen_when_it_drifts_least():
    from geminicompress.distill.cut import CutSpec, planned_student
    from geminicompress.distill.greedy import add_greedy

    model, windows = _with_identity_blocks([2, 5])
    full = walk(model, windows, device=CPU)
    fit, held = full.rows(0, 8), full.rows(8, 12)
    plan = make_plan(model, 6, fit.rows(0, 8), held, windows[8:], RepairSpec("down_proj"), shortlist=2)
    plan.candidates = [c for c in plan.candidates if c.dropped != [2, 5]]  # the fixed candidates miss it
    plan.candidates[0].chosen = True
    add_greedy(plan, model, fit, held, windows[8:], RepairSpec("down_proj"))
    d = json.loads(json.dumps(plan.as_dict()))
    assert d["chosen"]["kind"] == "greedy" and d["chosen"]["dropped"] == [2, 5]
    assert abs(d["chosen"]["drift"]) < 1e-4 and abs(d["predicted_drift"]) < 1e-4
    assert [s["block"] for s in d["greedy"]] in ([2, 5], [5, 2]) and sum(c["chosen"] for c in d["candidates"]) == 1
    # through planned_student (recipe plan_search: greedy): the student built drops the greedy set
    _, kept, table = planned_student(model, 6, windows, CutSpec(repair=RepairSpec("down_proj"), fit_windows=8,
                                                               search="greedy"))
    assert kept == [0, 1, 3, 4, 6, 7] and len(table["greedy"]) == 2


def test_recipe_plan_search_greedy_writes_its_steps(teacher6, text_file, tmp_path):
    recipe = tmp_path / "greedy.yaml"
    recipe.write_text(f"""model: {teacher6}
calibration: {{data: {text_file}, seq_len: 32}}
stages:
  - {{type: distill, data: {text_file}, student_layers: 4, train_minutes: 0, repair_windows: 4, plan_held_windows: 2,
     plan_search: greedy, plan_greedy_pool: 2}}
""")
    out = tmp_path / "out"
    res = _invoke("run", recipe, "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert [len(s["tried"]) for s in plan["greedy"]] == [4, 2]  # blocks 1-4, then the pool
    chosen = plan["chosen"]["repaired_drift"]
    assert chosen == min(c["repaired_drift"] for c in plan["candidates"] if c["repaired_drift"] is not None)
    assert any(c["dropped"] == plan["greedy"][-1]["dropped"] for c in plan["candidates"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("plan_search: greedy", "plan_search: greedyy"))
    res = _invoke("run", bad, "-o", tmp_path / "bad", "--quiet")
    assert res.exit_code == 2 and "plan_search" in res.output, res.output
