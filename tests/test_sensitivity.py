"""The sensitivity pass on a tiny Llama: table shape, KL semantics, proxy, heat-map, bad input."""

import json

import pytest
import torch
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.sensitivity.measure import measure_sensitivity, spearman, SensitivitySettings
from geminicompress.compress.sensitivity.options import parse_options
from geminicompress.compress.targets import decoder_linears as quantizable
from geminicompress.core.arch import arch_for
from geminicompress.core.errors import InputError

runner = CliRunner()


def windows(n=3, T=32, vocab=384):
    return torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(0))


def test_table_shapes_and_monotone_drift(model):
    options = parse_options("magnitude:0.2,magnitude:0.8,gptq:b8g-1,gptq:b2g16")
    keep = set(quantizable(model, arch_for(model), []))
    table = measure_sensitivity(model, windows(), options, SensitivitySettings(keep=keep, measure="both", kl_windows=2))
    assert len(table["units"]) == 2 * 7 and table["options"] == [o.label for o in options]
    for u in table["units"]:
        kl = u["kl"]
        assert all(v >= 0 for v in kl)
        assert kl[1] > kl[0]  # more pruning, more drift
        assert kl[3] > kl[2]  # 2-bit hurts more than 8-bit
        cols = 128 if "down_proj" in u["name"] else 64  # per channel: one 16-bit scale + 8-bit zero per row
        assert u["bits_per_weight"][2] == pytest.approx(8 + 24 / cols)
        assert u["kept"][:2] == pytest.approx([0.8, 0.2])
    assert -1 <= table["rank_correlation"]["all"] <= 1 and table["rank_correlation"]["all"] > 0.5


def test_fused_units_and_ignore(model):
    keep = {n for n in quantizable(model, arch_for(model), []) if "layers.1" in n}
    table = measure_sensitivity(model, windows(), parse_options("rtn:b4g16"), SensitivitySettings(keep=keep, fuse=True))
    assert [u["name"].split(".", 3)[-1] for u in table["units"]] == [
        "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj+mlp.up_proj",
        "mlp.down_proj"]
    assert table["units"][0]["layer"] == 1


def test_no_change_no_drift(model):
    keep = set(quantizable(model, arch_for(model), []))
    table = measure_sensitivity(model, windows(), parse_options("gptq:b8g16"), SensitivitySettings(keep=keep,
                                                                                                   measure="kl"))
    assert max(u["kl"][0] for u in table["units"]) < 1e-3  # 8-bit is nearly lossless


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


@pytest.mark.parametrize("text, needle", [
    ("foo:0.5", "unknown method 'foo'"),
    ("gptq:b4", "write gptq:b<bits>g<group size>"),
    ("gptq:b6g64", "bits must be 2, 3, 4, 5 or 8"),
    ("gptq:b4g0", "group size must be positive"),
    ("wanda:1.5", "sparsity in (0, 1)"),
])
def test_bad_options(text, needle):
    with pytest.raises(InputError, match=None) as exc:
        parse_options(text)
    assert needle in str(exc.value)


def test_cli_writes_table_and_heatmap(tiny_dir, text_file, tmp_path):
    out = tmp_path / "sens"
    res = runner.invoke(app, ["sensitivity", str(tiny_dir), "-o", str(out), "-q", "--data", str(text_file),
                              "--samples", "3", "--calib-seq-len", "32", "--options", "gptq:b4g32,gptq:b3g32",
                              "--measure", "both"])
    assert res.exit_code == 0, res.output
    table = json.loads((out / "sensitivity.json").read_text())
    assert len(table["units"]) == 14 and "all" in table["rank_correlation"]
    assert (out / "sensitivity.png").stat().st_size > 1000


@pytest.mark.parametrize("opts, needle", [("gptq:b4g48", "does not divide the 64 input features"),
                                          ("awq:b4g64", "unknown method")])
def test_cli_bad_options_one_line(tiny_dir, tmp_path, opts, needle):
    res = runner.invoke(app, ["sensitivity", str(tiny_dir), "-o", str(tmp_path / "s"), "-q", "--options", opts,
                              "--samples", "2", "--calib-seq-len", "16"])
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()
