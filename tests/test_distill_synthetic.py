"""Teacher-sampled repair windows (distill/synthetic.py) and `repair_synthetic` in the distill stage."""

import json

import pytest
import torch
from tiny import tiny_model

from geminicompress.distill.synthetic import prefix_len, teacher_samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _invoke(*args):
    from typer.testing import CliRunner

    from geminicompress.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_samples_start_with_the_windows_prefixes_and_repeat_with_the_seed():
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=2)
    windows = torch.randint(0, 384, (3, 40), generator=torch.Generator().manual_seed(1))
    state = torch.get_rng_state()
    a = teacher_samples(model, windows, 5, seed=7, batch=2)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left as it was
    p = prefix_len(40)
    assert a.shape == (5, 40) and p == 32
    assert torch.equal(a[:, :p], windows[[0, 1, 2, 0, 1], :p])  # the real windows' starts, cycled
    assert torch.equal(a, teacher_samples(model, windows, 5, seed=7, batch=2))  # the seed decides
    b = teacher_samples(model, windows, 5, seed=8, batch=2)
    assert not torch.equal(a[:, p:], b[:, p:])
    assert not torch.equal(a[:, p:], windows[[0, 1, 2, 0, 1], p:])  # written, not copied
    assert prefix_len(8) == 7 and prefix_len(2) == 1


def test_samples_follow_the_teachers_own_distribution():
    """Sampling at temperature 1: each sampled token's mean surprisal under the teacher equals the teacher's mean
    entropy at those positions (greedy decoding would be far below it, uniform sampling far above)."""
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # peaky distributions, so that the three differ
    windows = torch.randint(0, 384, (64, 40), generator=torch.Generator().manual_seed(2))
    ids = teacher_samples(model, windows, 64, seed=3)
    p = prefix_len(40)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[:, p - 1:-1].double(), -1)  # predicting positions p..T-1
    surprisal = -logp.gather(-1, ids[:, p:, None]).squeeze(-1).mean()
    entropy = -(logp.exp() * logp).sum(-1).mean()
    greedy = -logp.max(-1).values.mean()
    assert 0.3 < entropy < 5.0, entropy  # neither one-hot nor uniform (log 384 = 5.95)
    assert abs(surprisal - entropy) < 0.1 * entropy, (surprisal, entropy)
    assert greedy < 0.7 * entropy


@pytest.fixture(scope="module")
def teacher6(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("teacher") / "t6", num_hidden_layers=6)


def test_repair_synthetic_joins_the_fit_windows_not_the_held_out_ones(teacher6, text_file, tmp_path):
    plans = []
    for extra in ([], ["--repair-synthetic", "6"]):
        out = tmp_path / f"s{len(extra)}"
        res = _invoke("distill", "--teacher", teacher6, "--student-layers", "4", "--train-minutes", "0", "--data",
                      text_file, *extra, "--quiet", "-o", out)
        assert res.exit_code == 0, res.output
        plans.append(json.loads((out / "plan.json").read_text()))
    assert plans[0]["fit_windows"] == 32 and plans[1]["fit_windows"] == 38
    assert plans[0]["repair_synthetic"] == 0 and plans[1]["repair_synthetic"] == 6
    assert plans[1]["teacher_ppl"] == pytest.approx(plans[0]["teacher_ppl"], rel=1e-6)  # the same held-out windows
    fits = [{r["teacher_layer"]: r["error_after"] for r in p["repair_rows"]} for p in plans]
    shared = set(fits[0]) & set(fits[1])
    assert shared and any(fits[0][k] != pytest.approx(fits[1][k], rel=1e-6) for k in shared)  # another fit


@pytest.mark.parametrize("extra, says", [
    (["--repair", "none"], "repair_synthetic adds windows"),
    (["--repair-synthetic", "-1"], "repair_synthetic"),
])
def test_repair_synthetic_refused_in_one_line(teacher6, text_file, tmp_path, extra, says):
    args = ["--repair-synthetic", "4", *extra] if extra[0] != "--repair-synthetic" else extra
    out = tmp_path / "refused"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "4", "--train-minutes", "0", "--data", text_file,
                  *args, "--quiet", "-o", out)
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()


def test_a_walk_bigger_than_memory_is_refused_before_any_work(teacher6, text_file, tmp_path, monkeypatch):
    import geminicompress.distill.survey as survey

    monkeypatch.setattr(survey, "available_memory", lambda: 30 * 2**20)  # 30 MiB
    out = tmp_path / "big"
    res = _invoke("distill", "--teacher", teacher6, "--student-layers", "4", "--train-minutes", "0", "--data", text_file,
                  "--repair-synthetic", "4", "--quiet", "-o", out)
    # 7 boundaries x (32 + 4 + 4) windows x 512 tokens x 64 x 4 bytes = 35 MiB
    assert res.exit_code == 2 and "would hold 35 MiB" in res.output and "30 MiB are available" in res.output, res.output
    assert "lower repair_windows, repair_synthetic or plan_held_windows" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()
