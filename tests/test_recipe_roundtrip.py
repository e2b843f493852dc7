"""OUT/recipe.yaml runs again and says what ran: every recipe survives being written and read back, the
options a validator resolves (a 2:4 pattern's sparsity, a budget's steps, magnitude's true_sequential) are
written resolved, and a run of the written file writes the same OUT."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.int8.config import Int8Stage
from geminicompress.compress.prune.config import PruneStage
from geminicompress.core.config import ignore_to_check
from geminicompress.runtime.recipes.loader import bundled_recipes, recipe_yaml
from geminicompress.distill.config import DEFAULT_STEPS
from geminicompress.runtime.recipes.schema import STAGE_CONFIGS, Recipe

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _stage(tag: str, **options) -> dict:
    kind, _, method = tag.partition(":")
    return {"type": kind, **({"method": method} if method else {}), **options}


CASES = {
    **{tag: [_stage(tag)] for tag in STAGE_CONFIGS},
    "prune sparsegpt": [_stage("prune", method="sparsegpt")],
    "prune 2:4": [_stage("prune", method="wanda", pattern="2:4")],
    "prune owl": [_stage("prune", method="wanda", allocation="owl")],
    "prune global": [_stage("prune", allocation="global")],
    "distill minutes": [_stage("distill", student_layers=24, train_minutes=3)],
    "distill tokens": [_stage("distill", student_layers=24, train_tokens=3000)],
    "distill steps": [_stage("distill", student_layers=24, steps=5)],
    "distill repair only": [_stage("distill", student_layers=24, train_minutes=0)],
    "int8 gguf": [_stage("quantize:int8", format="gguf")],
    "prune then eval": [_stage("prune"), _stage("eval")],
}
FILES = sorted(ROOT.glob("benchmarks/results/*recipe*.yaml"))


def _round_trip(recipe: Recipe) -> Recipe:
    return Recipe.model_validate(yaml.safe_load(recipe_yaml(recipe)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_stage_survives_its_written_recipe(name):
    recipe = Recipe(model="m", stages=CASES[name])
    again = _round_trip(recipe)
    assert again.model_dump() == recipe.model_dump()
    assert recipe_yaml(again) == recipe_yaml(recipe)  # a fixed point: writing it again changes nothing


@pytest.mark.parametrize("path", [*bundled_recipes().values(), *FILES], ids=lambda p: Path(p).name)
def test_every_shipped_recipe_survives_being_written(path):
    recipe = Recipe.model_validate(yaml.safe_load(Path(path).read_text()))
    assert _round_trip(recipe).model_dump() == recipe.model_dump()


def test_resolved_options_are_written_as_run():
    two_four = PruneStage(type="prune", method="wanda", pattern="2:4")
    assert two_four.sparsity == 0.5  # not the 0.4 default the run never used
    assert PruneStage(type="prune").true_sequential is None  # magnitude takes none
    assert PruneStage(type="prune", method="sparsegpt").true_sequential is True
    with pytest.raises(ValueError, match="true_sequential applies"):
        PruneStage(type="prune", true_sequential=False)
    with pytest.raises(ValueError, match="leave out sparsity"):
        PruneStage(type="prune", pattern="2:4", sparsity=0.4)
    distill = lambda **o: Recipe(model="m", stages=[_stage("distill", student_layers=2, **o)]).stages[0]  # noqa: E731
    assert distill().steps == DEFAULT_STEPS
    assert distill(train_minutes=3).steps is None and distill(train_tokens=100).steps is None
    with pytest.raises(ValueError, match="one training budget"):
        distill(train_minutes=3, steps=5)


def test_only_added_ignore_patterns_must_match():
    assert ignore_to_check(PruneStage(type="prune")) == []
    assert ignore_to_check(PruneStage(type="prune", ignore=["lm_head", "embed_tokens", "typo"])) == ["typo"]
    assert ignore_to_check(Int8Stage(type="quantize", method="int8", ignore=["lm_head", "q_proj"])) == ["q_proj"]


def test_a_streamed_bf16_run_writes_its_dtype_and_runs_again(sharded, tmp_path):
    """A streamed run keeps the input's bf16; its recipe.yaml says so, and running that file again (here in
    memory) writes the same bf16 weights. Before, it said float32 (the in-memory default), and a second run
    from it failed (magnitude's true_sequential) or would have written float32."""
    out, again = tmp_path / "out", tmp_path / "again"
    res = runner.invoke(app, ["prune", str(sharded), "-o", str(out), "--stream", "-q"])
    assert res.exit_code == 0, res.output
    written = yaml.safe_load((out / "recipe.yaml").read_text())
    assert written["output"]["dtype"] == "bfloat16"
    res = runner.invoke(app, ["run", str(out / "recipe.yaml"), "-o", str(again), "-q"])
    assert res.exit_code == 0, res.output
    first = {k: v for f in sorted(out.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}
    second = {k: v for f in sorted(again.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}
    assert first.keys() == second.keys()
    assert first["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for k in first:
        assert first[k].dtype == second[k].dtype
        assert torch.equal(first[k], second[k]), k
    assert (again / "recipe.yaml").read_text() == (out / "recipe.yaml").read_text()
