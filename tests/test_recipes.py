"""Recipe validation: each class of bad input is one line naming the file and key, exit 2, nothing written."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from geminicompress.runtime import methods, pipeline
from geminicompress.cli import app
from geminicompress.core.errors import InputError
from geminicompress.runtime.recipes.loader import apply_overrides, bundled_recipes, load_recipe

runner = CliRunner()


def write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def good(tiny_dir, **extra):
    return {"model": str(tiny_dir), "stages": [{"type": "quantize", "method": "gptq", "bits": 4}], **extra}


def test_valid_recipe_validates(tiny_dir, tmp_path):
    path = write(tmp_path, good(tiny_dir))
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    assert "quantize:gptq" in res.output


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r["stages"][0].update(bitz=3), "stages.0.bitz: unknown key"),
        (lambda r: r["stages"][0].update(bits=7), "stages.0.bits: Input should be 2, 3, 4, 5 or 8 (got 7)"),
        (lambda r: r["stages"][0].update(damp=2.0), "stages.0.damp: Input should be less than 1"),
        (lambda r: r.update(calibration={"samples": 0}), "calibration.samples: Input should be greater than or equal to 1"),
        (lambda r: r["stages"][0].update(method="int3"), "stages.0: unknown stage"),
        (lambda r: r["stages"].insert(0, {"type": "eval"}), "eval stages go last"),
        (lambda r: r.pop("model"), "model: required key is missing"),
        (lambda r: r.update(model="./no/such/dir"), "model: model directory ./no/such/dir does not exist"),
        (lambda r: r["stages"][0].update(data="missing.jsonl"), "stages.0.data: data file missing.jsonl does not exist"),
        (lambda r: r.update(typo_key=1), "typo_key: unknown key"),
        (lambda r: r["stages"].__setitem__(0, {"type": "prune", "pattern": "5:4"}),
         "stages.0.pattern: pattern must be N:M with 0 < N < M (e.g. 2:4), got '5:4'"),
        (lambda r: r["stages"].__setitem__(0, {"type": "distill", "topk_cache": 8, "loss": {"hidden_mse": 1.0}}),
         "stages.0: topk_cache stores logits only; hidden-state losses need the teacher online (drop one)"),
    ],
)
def test_bad_recipes(tiny_dir, tmp_path, mutate, needle):
    data = good(tiny_dir)
    mutate(data)
    path = write(tmp_path, data)
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    assert str(path) in res.output
    assert needle in res.output
    assert res.output.count("got ") <= 1  # a message that says what it got is not given a second "(got ...)"
    assert len(res.output.strip().splitlines()) == 1
    # run gives the same error and writes nothing
    res = runner.invoke(app, ["run", str(path), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2 and needle in res.output
    assert not (tmp_path / "out").exists()


def test_invalid_yaml_and_missing_file(tmp_path):
    path = write(tmp_path, "model: [unclosed\n")
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 2 and "not valid YAML" in res.output
    res = runner.invoke(app, ["validate", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_yaml_is_read_safely(tmp_path):
    path = write(tmp_path, "model: !!python/object/apply:os.system ['echo pwned']\nstages: []\n")
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 2 and "not valid YAML" in res.output


def test_set_overrides(tiny_dir, tmp_path):
    path = write(tmp_path, good(tiny_dir))
    recipe, _ = load_recipe(str(path), ["stages.0.bits=3", "stages.0.group_size=-1", "seed=7"])
    assert recipe.stages[0].bits == 3 and recipe.stages[0].group_size == -1 and recipe.seed == 7
    with pytest.raises(InputError, match="not an index"):
        load_recipe(str(path), ["stages.5.bits=3"])
    with pytest.raises(InputError, match="use KEY.PATH=VALUE"):
        load_recipe(str(path), ["stages.0.bits"])
    res = runner.invoke(app, ["validate", str(path), "--set", "stages.0.bits=9"])
    assert res.exit_code == 2 and "stages.0.bits" in res.output


def test_apply_overrides_nested_dict():
    assert apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]"]) == {"a": {"b": 1, "c": [1, 2]}}


def test_schema_prints_json():
    res = runner.invoke(app, ["validate", "--schema"])
    assert res.exit_code == 0
    schema = json.loads(res.output)
    assert "stages" in schema["properties"]


def test_every_bundled_recipe_validates(tiny_dir):
    names = bundled_recipes()
    assert "quickstart" in names
    for name in names:
        recipe, _ = load_recipe(name, [f"model={tiny_dir}"])
        assert recipe.stages
        for tag in (methods.stage_tag(s) for s in recipe.stages):
            assert tag in methods.STAGES
