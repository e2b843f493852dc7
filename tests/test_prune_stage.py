"""The prune stage on a tiny Llama: every method, masks, formats that round-trip, and bad input via the CLI."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.prune.stage import prunable_weights
from geminicompress.core.arch import arch_for
from geminicompress.models.loading import load_model

runner = CliRunner()
CAL = ["--samples", "4", "--calib-seq-len", "32"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def prunable(model):
    return {n: lin.weight.detach() for n, lin in prunable_weights(model, arch_for(model), ["lm_head"], []).items()}


def run_prune(tiny_dir, out, *args):
    res = invoke("prune", tiny_dir, "-o", out, "-q", *args)
    assert res.exit_code == 0, res.output
    return json.loads((out / "report.json").read_text())["stages"][0]["result"]


@pytest.mark.parametrize("args, sparsity, per_layer", [
    ([], 0.4, False),
    (["--sparsity", "0.5", "--scope", "layer"], 0.5, True),
    (["--method", "wanda"], 0.4, True),
    (["--method", "sparsegpt", "--sparsity", "0.5"], 0.5, True),
])
def test_methods_reach_sparsity_and_zeros_survive_save_load(tiny_dir, text_file, tmp_path, args, sparsity, per_layer):
    out = tmp_path / "out"
    summary = run_prune(tiny_dir, out, "--data", text_file, *CAL, *args)
    weights = prunable(load_model(str(out)).model)
    zeros = sum(int((w == 0).sum()) for w in weights.values())
    total = sum(w.numel() for w in weights.values())
    # global/layer magnitude: exact count; per-row methods: within half a weight per row of 64 or 128 columns
    assert abs(zeros / total - sparsity) < (1e-3 if args[:2] != ["--method", "wanda"] else 0.5 / 64)
    assert summary["pruned_params"] == zeros and summary["prunable_params"] == total
    if per_layer:
        assert all(abs(r["sparsity"] - sparsity) < 0.02 for r in summary["layers"])
    masks = load_file(str(out / "prune_masks.safetensors"))
    assert set(masks) == set(weights)
    for name, w in weights.items():
        assert masks[name].dtype == torch.bool and masks[name].shape == w.shape
        assert not w[~masks[name]].any()  # every pruned weight is an exact zero on disk
    assert (out / "prune_sparsity.png").stat().st_size > 1000


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_two_four_every_method_compressed_tensors_round_trip(tiny_dir, text_file, tmp_path, method):
    out = tmp_path / "out"
    run_prune(tiny_dir, out, "--method", method, "--pattern", "2:4", "--format", "compressed-tensors",
              "--data", text_file, *CAL)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["sparsity_config"]["format"] == "sparse-24-bitmask"
    loaded = load_model(str(out))
    assert loaded.format == "compressed-tensors:sparse-24-bitmask"
    for w in prunable(loaded.model).values():
        assert ((w == 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all()


def test_compressed_tensors_matches_dense_and_shrinks(tiny_dir, tmp_path):
    dense, packed = tmp_path / "dense", tmp_path / "packed"
    run_prune(tiny_dir, dense, "--sparsity", "0.7")
    run_prune(tiny_dir, packed, "--sparsity", "0.7", "--format", "compressed-tensors")
    a, b = load_model(str(dense)).model, load_model(str(packed)).model
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.randint(0, 300, (1, 16))
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert (packed / "model.safetensors").stat().st_size < 0.8 * (dense / "model.safetensors").stat().st_size


def test_global_scope_differs_per_layer_and_ignore(tiny_dir, tmp_path):
    summary = run_prune(tiny_dir, tmp_path / "out", "--sparsity", "0.6", "--ignore", "lm_head",
                        "--ignore", r"layers\.1\.mlp")
    names = [r["name"] for r in summary["layers"]]
    assert "model.layers.1.mlp.up_proj.weight" not in names and "model.layers.0.mlp.up_proj.weight" in names
    assert summary["achieved_sparsity"] == pytest.approx(0.6, abs=1e-3)
    assert summary["threshold"] > 0
    model = load_model(str(tmp_path / "out")).model
    assert not (model.model.layers[1].mlp.up_proj.weight == 0).any()


def test_stage_sets_masks_for_distill(tiny_dir):
    from geminicompress.engine.contract import StageContext
    from geminicompress.host.progress import NullProgress
    from geminicompress.compress.prune.config import PruneStage
    from geminicompress.runtime.recipes.schema import Recipe
    from geminicompress.runtime.stages import run_stage

    loaded = load_model(str(tiny_dir))
    recipe = Recipe(model=str(tiny_dir), stages=[{"type": "prune", "sparsity": 0.95}])
    warnings = []

    class Progress(NullProgress):
        def warn(self, message):
            warnings.append(message)

    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        ctx = StageContext(loaded.model, loaded.tokenizer, loaded.source, recipe, Progress(), torch.device("cpu"),
                           Path(d), Path(d))
        summary = run_stage(PruneStage(type="prune", sparsity=0.95), ctx)[1]
    assert set(ctx.masks) == {r["name"] for r in summary["layers"]}
    assert warnings and all("under the global threshold" in w for w in warnings)
    assert len(warnings) == len(summary["layers_over_90pct"])


@pytest.mark.parametrize("args, needle", [
    (["--sparsity", "-0.1"], "sparsity: Input should be greater than or equal to 0"),
    (["--sparsity", "1.0"], "sparsity: Input should be less than 1"),
    (["--pattern", "3:2"], "pattern must be N:M with 0 < N < M"),
    (["--pattern", "2-4"], "pattern must be N:M"),
    (["--method", "sparsegpt", "--scope", "global"], "scope 'global' applies to magnitude pruning only"),
    (["--pattern", "2:4", "--scope", "global"], "cannot use scope 'global'"),
    (["--pattern", "2:4", "--sparsity", "0.3"], "pattern 2:4 prunes exactly 2/4"),
    (["--method", "obs"], "method"),
    (["--ignore", "no_such_module"], "ignore pattern 'no_such_module' matches no module"),
    (["--ignore", "(unclosed"], "is not a regular expression"),
    (["--pattern", "3:7"], "not a multiple of M=7"),
])
def test_bad_input_one_line(tiny_dir, tmp_path, args, needle):
    res = invoke("prune", tiny_dir, "-o", tmp_path / "out", "-q", *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_every_calibrated_criterion_is_a_schema_method_and_back():
    """A criterion is one function plus one row of CALIBRATED; the schema's method list must name it."""
    import typing

    from geminicompress.compress.prune.stage import CALIBRATED
    from geminicompress.compress.prune.config import PruneStage

    assert set(typing.get_args(PruneStage.model_fields["method"].annotation)) == {"magnitude", *CALIBRATED}


def test_ignoring_a_non_linear_module_is_accepted(model):
    """prune's default ignore names embed_tokens, which is not a linear: an explicit one is no error."""
    names = prunable_weights(model, arch_for(model), ["lm_head", "embed_tokens"], ["lm_head", "embed_tokens"])
    assert list(names) == list(prunable(model)) and len(names) == 7 * model.config.num_hidden_layers
