"""Non-uniform sparsity: OWL math, exact totals, and the prune stage with an allocation on a tiny Llama."""

import json

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.prune.allocate import exact_counts, outlier_ratio, owl_layer_sparsity
from geminicompress.compress.prune.masks import row_mask_count
from geminicompress.compress.prune.stage import prunable_weights
from geminicompress.core.arch import arch_for
from geminicompress.core.errors import InputError
from geminicompress.models.loading import load_model

runner = CliRunner()
CAL = ["--samples", "4", "--calib-seq-len", "32"]


def test_outlier_ratio_known_answer():
    s = torch.tensor([1.0] * 18 + [100.0, 100.0])  # mean 10.9: two scores above 5 x mean (54.5)
    assert outlier_ratio([s[:10], s[10:]], 5.0) == pytest.approx(2 / 20)


def test_owl_layer_sparsity_weighted_mean_and_order():
    ratios, params, target, lam = [0.01, 0.05, 0.03, 0.02], [100, 100, 300, 100], 0.4, 0.08
    s = owl_layer_sparsity(ratios, params, target, lam)
    assert sum(a * n for a, n in zip(s, params)) / sum(params) == pytest.approx(target)
    assert s[1] == min(s) and s[0] == max(s)  # most outliers -> least pruned
    assert max(s) - min(s) == pytest.approx(2 * lam)
    assert owl_layer_sparsity([0.1, 0.1], [5, 7], 0.3, 0.08) == pytest.approx([0.3, 0.3])
    with pytest.raises(InputError, match="lower owl_lambda"):
        owl_layer_sparsity([0.0, 1.0], [1, 1], 0.05, 0.2)


@pytest.mark.parametrize("seed", range(5))
def test_exact_counts_sum_to_target(seed):
    g = torch.Generator().manual_seed(seed)
    params = {f"m{i}": int(torch.randint(10, 1000, (1,), generator=g)) for i in range(7)}
    sparsity = {k: float(torch.rand(1, generator=g)) * 0.9 for k in params}
    counts = exact_counts(params, sparsity, 0.4)
    assert sum(counts.values()) == round(0.4 * sum(params.values()))
    assert all(0 <= counts[k] <= params[k] for k in params)


def test_row_mask_count_is_exact_and_per_row():
    scores = torch.rand(8, 10, generator=torch.Generator().manual_seed(0))
    keep = row_mask_count(scores, 43)
    assert int((~keep).sum()) == 43
    assert sorted((~keep).sum(1).tolist()) == [5] * 5 + [6] * 3
    row = scores[0]
    pruned = row[~keep[0]]
    assert pruned.max() < row[keep[0]].min()  # the lowest of the row


def run_prune(tiny_dir, out, *args):
    res = runner.invoke(app, ["prune", str(tiny_dir), "-o", str(out), "-q", *map(str, args)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "report.json").read_text())["stages"][0]["result"]


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_owl_allocation_total_and_non_uniform(tiny_dir, text_file, tmp_path, method):
    out = tmp_path / "out"
    summary = run_prune(tiny_dir, out, "--data", text_file, *CAL, "--method", method, "--allocation", "owl",
                        "--sparsity", "0.4")
    model = load_model(str(out)).model
    weights = {n: lin.weight for n, lin in prunable_weights(model, arch_for(model), ["lm_head"], []).items()}
    zeros = sum(int((w == 0).sum()) for w in weights.values())
    total = sum(w.numel() for w in weights.values())
    if method != "sparsegpt":  # sparsegpt selects per block of columns: within a block's rounding
        assert zeros == round(0.4 * total)
    else:
        assert abs(zeros / total - 0.4) < 0.01
    assert summary["allocation"] == "owl"
    layer_s = summary["owl_layer_sparsity"]
    assert len(layer_s) == 2 and layer_s[0] != layer_s[1]
    assert max(layer_s) - min(layer_s) == pytest.approx(0.16, abs=1e-6)


@pytest.mark.parametrize("args, needle", [
    (["--method", "wanda", "--allocation", "global"], "allocation 'global' is one magnitude threshold"),
    (["--allocation", "owl", "--pattern", "2:4"], "takes no allocation"),
    (["--allocation", "owl", "--scope", "global"], "contradicts scope"),
    (["--allocation", "cheap"], "allocation"),
    (["--allocation", "sensitivity", "--sensitivity", "/no/such.json"], "does not exist"),
])
def test_allocation_bad_input_one_line(tiny_dir, tmp_path, args, needle):
    res = runner.invoke(app, ["prune", str(tiny_dir), "-o", str(tmp_path / "out"), "-q", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
