"""Refuse before loading (issue #34): what config.json alone can refuse (the architecture, shapes against the
group size and format, an N:M pattern) is one line, exit 2, before any weight is read."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from geminicompress.runtime import pipeline
from geminicompress.runtime import plan as preflight_mod
from geminicompress.cli import app
from geminicompress.core.errors import InputError
from geminicompress.host.output import partial_dir

runner = CliRunner()


@pytest.fixture
def no_loading(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(pipeline, "load_model", loaded)
    monkeypatch.setattr(pipeline, "LazyCheckpoint", loaded)


def _refused(result, out) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "AssertionError" not in result.output, result.output
    assert not out.exists() and not partial_dir(out).exists()
    return lines[0]


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
@pytest.mark.parametrize("args, said", [
    (["quantize", "--method", "gptq", "--group-size", "48"], "group size 48 does not divide the 64 input features"),
    (["quantize", "--method", "awq", "--bits", "3"], "the AWQ format holds 4-bit weights only"),
    (["prune", "--pattern", "3:7"], "not a multiple of M=7 in pattern 3:7"),
])
def test_shapes_that_do_not_fit_are_refused_before_loading(tiny_dir, tmp_path, no_loading, args, said, stream):
    out = tmp_path / "out"
    line = _refused(runner.invoke(app, [args[0], str(tiny_dir), "-o", str(out), *args[1:], stream, "-q"]), out)
    assert said in line, line


def test_an_unsupported_architecture_is_refused_before_loading(tiny_dir, tmp_path, no_loading, monkeypatch):
    """The refusal is `arch_for`'s (the one function that knows the architectures), asked of the config's skeleton."""
    seen = []

    def arch_for(model):
        seen.append(model.config.model_type)
        raise InputError(f"architecture '{model.config.model_type}' is not supported")

    monkeypatch.setattr(preflight_mod, "arch_for", arch_for)
    out = tmp_path / "out"
    line = _refused(runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", "int8", "-q"]), out)
    assert line == "error: architecture 'llama' is not supported" and seen == ["llama"]


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_the_auto_group_size_is_resolved_once_where_the_run_is_planned(tiny_dir, tmp_path, monkeypatch, stream, method):
    """`--group-size auto` is resolved on the skeleton before loading (preflight); the stage opens with that plan
    (it says the size, it does not resolve it again)."""
    from geminicompress.compress import targets

    widths = []
    real = targets.auto_group_size
    monkeypatch.setattr(targets, "auto_group_size", lambda found: widths.append(found) or real(found))
    out = tmp_path / "out"
    args = ["--samples", "2", "--calib-seq-len", "32", "--n-grid", "2"] if method == "awq" else []
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", method, stream, "--no-verify",
                              *args])
    assert res.exit_code == 0, res.output
    assert len(widths) == 1, widths
    assert res.output.count("(auto: largest of 128/64/32") == 1, res.output


def test_the_plan_reads_the_skeleton_once(tiny_dir, tmp_path, monkeypatch):
    """MODEL's skeleton is built once per run, where the run is planned: the whole-model check (are there decoder
    layers?) and preflight (the group size, the shapes) both read it (they each built one before)."""
    built = []
    real = preflight_mod.skeleton
    monkeypatch.setattr(preflight_mod, "skeleton", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    out = tmp_path / "out"
    res = runner.invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", "rtn", "--no-stream",
                              "--no-verify", "-q"])
    assert res.exit_code == 0, res.output
    assert len(built) == 1


def _recipe(model, **top):
    from geminicompress.runtime.recipes.loader import validate

    return validate({"model": str(model), "stages": [{"type": "quantize", "method": "rtn", "bits": 4}], **top}, "test")


@pytest.mark.parametrize("asked, recipe_threads, resumed, want", [
    (None, 2, 3, (None, None)),            # a library call: the caller's own count, untouched
    (5, 2, 3, (5, "--threads")),           # --threads wins over the recipe and the interrupted run
    ("auto", 2, 3, (2, "recipe")),         # then the recipe's `threads:`
    ("auto", None, 3, (3, "resume")),      # then the interrupted run's, which this one resumes
])
def test_the_plan_chooses_the_threads(tiny_dir, tmp_path, asked, recipe_threads, resumed, want):
    """The run's threads are part of its plan: --threads, else the recipe's, else the count of the interrupted
    run on OUT with the same fingerprint (its bytes depend on it), else the free cores."""
    from geminicompress.host.output import OutputDir, STATE_DIR, THREADS_FILE
    from geminicompress.runtime.options import RunOptions

    out = tmp_path / "out"
    recipe = _recipe(tiny_dir, **({"threads": recipe_threads} if recipe_threads else {}))
    key = preflight_mod.fingerprint(recipe)
    with pytest.raises(RuntimeError):  # an interrupted run: its state (fingerprint, threads) stays in .out.partial
        with OutputDir(out, fingerprint=key):
            state = partial_dir(out) / STATE_DIR
            (state / THREADS_FILE).write_text(f'{{"threads": {resumed}}}')
            (state / "0-quantize").mkdir()
            (state / "0-quantize" / "layer_0.pt").write_bytes(b"done")  # a layer done: something to resume
            raise RuntimeError("interrupted")
    plan = preflight_mod.plan_run(recipe, out, RunOptions(threads=asked))
    got = (plan.threads.threads, plan.threads.source) if plan.threads is not None else (None, None)
    assert got == want
    if asked == "auto" and recipe_threads is None:  # another recipe does not resume that run: the free cores
        other = _recipe(tiny_dir, seed=7)
        assert preflight_mod.plan_run(other, out, RunOptions(threads="auto")).threads.source == "auto"


def test_the_plan_refuses_an_output_over_the_recipe_file(tiny_dir, tmp_path):
    """The recipe's YAML file is an input too: OUT must not hold it, with or without --force."""
    from geminicompress.runtime.options import RunOptions

    out = tmp_path / "runs"
    out.mkdir()
    (out / "recipe.yaml").write_text("model: x\n")
    with pytest.raises(InputError, match=r"recipe file"):
        preflight_mod.plan_run(_recipe(tiny_dir), out, RunOptions(force=True, recipe_file=out / "recipe.yaml"))
    assert (out / "recipe.yaml").is_file()


def test_a_config_that_is_not_json_is_one_line(tiny_dir, tmp_path, no_loading):
    import shutil

    model = shutil.copytree(tiny_dir, tmp_path / "broken")  # the session's tiny model stays whole
    (model / "config.json").write_text('{"model_type": "llama",')
    out = tmp_path / "out"
    line = _refused(runner.invoke(app, ["quantize", str(model), "-o", str(out), "--method", "rtn", "-q"]), out)
    assert line.startswith(f"error: {model / 'config.json'} cannot be read as JSON"), line


@pytest.mark.parametrize("stream", [True, None])
def test_the_plan_reads_config_json_once(tiny_dir, tmp_path, monkeypatch, stream):
    """The plan parses MODEL's config.json once: preflight and the streaming decision read the same dict."""
    from geminicompress.models import headers
    from geminicompress.runtime.options import RunOptions

    read = []
    real = headers.read_config
    counted = lambda folder: read.append(folder) or real(folder)  # noqa: E731
    monkeypatch.setattr(headers, "read_config", counted)
    monkeypatch.setattr(preflight_mod, "read_config", counted)
    plan = preflight_mod.plan_run(_recipe(tiny_dir), tmp_path / "out", RunOptions(stream=stream))
    assert (plan.stream_from is not None) == bool(stream) and len(read) == 1
