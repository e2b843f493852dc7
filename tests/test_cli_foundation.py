"""CLI and pipeline contract: help, errors as one line with exit codes, atomic outputs that transformers loads."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from geminicompress.runtime import methods
from geminicompress.cli import app
import stage_for_tests

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("cmd", ["quantize", "prune", "distill", "eval", "run", "validate", "recipes"])
def test_every_command_has_help(cmd):
    res = invoke(cmd, "--help")
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_every_registered_method_resolves_to_its_config_and_runner():
    """The method class is the one declaration: its config accepts exactly its method name, it opens a
    layer stage, and the CLI, schema and pipeline all list it."""
    import typing

    from geminicompress.runtime.methods import METHODS
    from geminicompress.runtime.recipes.schema import STAGE_CONFIGS

    for name, m in METHODS.items():
        assert name in typing.get_args(m.config.model_fields["method"].annotation)
        assert m.name == name and m.tag() == f"quantize:{name}" and m.kind == "layers"
        assert STAGE_CONFIGS[f"quantize:{name}"] is m.config
        assert m.default_format == m.config.model_fields["format"].default
    assert "rtn" in invoke("quantize", "--help").output


def test_pipeline_writes_loadable_output_with_report(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(stage_for_tests.zero_first_layer))
    before = AutoModelForCausalLM.from_pretrained(tiny_dir).model.layers[0].self_attn.q_proj.weight.clone()
    out = tmp_path / "out"
    res = invoke("prune", tiny_dir, "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    assert torch.count_nonzero(model.model.layers[0].self_attn.q_proj.weight) == 0
    # the input model is never modified
    again = AutoModelForCausalLM.from_pretrained(tiny_dir).model.layers[0].self_attn.q_proj.weight
    assert torch.equal(before, again)
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][0]["stage"] == "prune"
    assert report["stages"][0]["result"] == {"zeroed": "model.layers.0.self_attn.q_proj"}
    assert report["stages"][0]["options"]["sparsity"] == 0.4
    assert {"torch", "transformers"} <= set(report["versions"])
    assert "cpu_count" in report["machine"]
    assert (out / "recipe.yaml").is_file()
    assert not (out / "state").exists()
    assert not list(tmp_path.glob(".*partial"))


def test_existing_output_needs_force(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(stage_for_tests.zero_first_layer))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = invoke("prune", tiny_dir, "-o", out)
    assert res.exit_code == 2
    assert "already exists" in res.output and "--force" in res.output
    assert (out / "keep.txt").read_text() == "mine"
    res = invoke("prune", tiny_dir, "-o", out, "--force", "-q")
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_failed_stage_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(methods.STAGES, "prune", stage_for_tests.model_stage(stage_for_tests.explode))
    res = invoke("prune", tiny_dir, "-o", tmp_path / "out", "-q")
    assert res.exit_code == 1
    assert "stage failed halfway" in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--method", "int4"], "--method 'int4' is not one of"),
        (["--method", "int8", "--act-order", "static"], "--act-order does not apply to --method int8"),
        (["--method", "gptq", "--bits", "6"], "bits: Input should be 2, 3, 4, 5 or 8 (got 6)"),
        (["--method", "w8a8", "--smoothquant-alpha", "1.5"], "smoothquant_alpha"),
        (["--method", "gptq", "--data", "nope.txt"], "data file nope.txt does not exist"),
    ],
)
def test_bad_quantize_options_one_line_exit_2(tiny_dir, tmp_path, args, needle):
    res = invoke("quantize", tiny_dir, "-o", tmp_path / "out", *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sparsity", "1.0"], "sparsity: Input should be less than 1"),
        (["--pattern", "3:2"], "pattern must be N:M"),
        (["--method", "wanda", "--scope", "global"], "scope 'global' applies to magnitude pruning only"),
    ],
)
def test_bad_prune_options(tiny_dir, tmp_path, args, needle):
    res = invoke("prune", tiny_dir, "-o", tmp_path / "out", *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_bad_models(tmp_path):
    res = invoke("prune", tmp_path / "missing", "-o", tmp_path / "out")
    assert res.exit_code == 2 and "does not exist" in res.output
    (tmp_path / "empty").mkdir()
    res = invoke("prune", tmp_path / "empty", "-o", tmp_path / "out")
    assert res.exit_code == 2 and "no config.json" in res.output


def test_recipes_lists_bundled():
    res = invoke("recipes")
    assert res.exit_code == 0
    assert "quickstart" in res.output
    res = invoke("recipes", "quickstart")
    assert "stages:" in res.output
    assert invoke("recipes", "nope").exit_code == 2


def test_every_method_option_comes_from_its_config():
    """Adding an option to a method is one field in its config: `quantize` and `prune` take every field of the
    registry's configs (those a recipe alone sets, such as overrides, excepted) as an option with help."""
    import inspect

    from geminicompress.commands.prune import prune
    from geminicompress.commands.quantize import quantize
    from geminicompress.runtime.methods import METHODS
    from geminicompress.compress.prune.config import PruneStage

    skip = {"type", "method", "data", "allocation", "overrides"}
    for command, configs in ((quantize, [m.config for m in METHODS.values()]), (prune, [PruneStage])):
        params = inspect.signature(command).parameters
        fields = {f for cls in configs for f in cls.model_fields} - skip
        assert fields <= set(params), fields - set(params)
        assert all(params[f].default.help for f in fields)
    res = invoke("quantize", "--help")
    assert "--search-windows" in res.output and "--multi-pass" in res.output and "--asym" in res.output
