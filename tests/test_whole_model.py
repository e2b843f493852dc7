"""The whole-model fallback (issue #36): on a model with linears but no decoder layers (no list of repeated
blocks), global magnitude pruning, RTN and int8 run on the whole model in memory; everything else, and any
streamed run, refuses in one line (exit 2) naming what is missing and what works.

The model: a tiny causal LM registered with transformers in this process (no ModuleList anywhere: an
embedding, one MLP in an nn.Sequential, a norm and a head), saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from geminicompress.core.trace import find_layers
from geminicompress.core.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


class FlatConfig(PretrainedConfig):
    model_type = "gc_flat_test"

    def __init__(self, vocab_size: int = 384, hidden_size: int = 64, intermediate_size: int = 128, **kwargs) -> None:
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class FlatForCausalLM(PreTrainedModel):
    """Linears, but no decoder layers: embed -> x + mlp(x) -> norm -> head (mlp an nn.Sequential)."""

    config_class = FlatConfig
    base_model_prefix = "flat"

    def __init__(self, config: FlatConfig) -> None:
        super().__init__(config)
        h, i = config.hidden_size, config.intermediate_size
        self.embed = nn.Embedding(config.vocab_size, h)
        self.mlp = nn.Sequential(nn.Linear(h, i), nn.GELU(), nn.Linear(i, h))
        self.norm = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        x = self.embed(input_ids)  # (B, T, h)
        x = x + self.mlp(x)
        return CausalLMOutput(logits=self.lm_head(self.norm(x)))


AutoConfig.register(FlatConfig.model_type, FlatConfig, exist_ok=True)
AutoModelForCausalLM.register(FlatConfig, FlatForCausalLM, exist_ok=True)

LINEARS = ("mlp.0", "mlp.2")


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory) -> Path:
    from tiny import tiny_tokenizer

    torch.manual_seed(0)
    model = FlatForCausalLM(FlatConfig()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("flat") / "flat"
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _run(flat_dir: Path, out: Path, *args: str):
    from typer.testing import CliRunner

    from geminicompress.cli import app

    return CliRunner().invoke(app, [args[0], str(flat_dir), "-o", str(out), *args[1:]])


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from geminicompress.models.loading import load_model

    model = load_model(str(path)).model
    return {n: m.weight.detach().float().clone() for n, m in model.named_modules() if n in (*LINEARS, "lm_head")
            and hasattr(m, "weight")} | {"_model": model}


def _logit_error(a: nn.Module, b: nn.Module) -> float:
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        x, y = a(ids).logits, b(ids).logits
    return float((x - y).norm() / y.norm())


def test_no_decoder_layers_found(flat_dir):
    with pytest.raises(InputError, match="no decoder layers found"):
        find_layers(FlatForCausalLM(FlatConfig()))


def test_magnitude_prunes_exactly_the_global_smallest(flat_dir, tmp_path):
    out = tmp_path / "mag"
    res = _run(flat_dir, out, "prune", "--sparsity", "0.5")
    assert res.exit_code == 0, res.output
    assert "no decoder layers found; magnitude pruning runs on the whole model in memory" in res.output
    base, got = _weights(flat_dir), _weights(out)
    # exactly half of the two MLP linears' weights (default ignore: lm_head, embed_tokens), the smallest |w|
    both = torch.cat([base[n].abs().flatten() for n in LINEARS])
    k = round(0.5 * both.numel())
    zero = torch.cat([(got[n] == 0).flatten() for n in LINEARS])
    assert int(zero.sum()) == k
    threshold = both.sort().values[k - 1]
    assert bool((both[zero] <= threshold).all()) and bool((both[~zero] >= threshold).all())
    for n in LINEARS:  # the kept weights are untouched
        assert torch.equal(got[n][got[n] != 0], base[n][got[n] != 0])
    assert torch.equal(got["lm_head"], base["lm_head"])
    import json

    report = json.loads((out / "report.json").read_text())
    assert report["export"]["whole_model"] and report["export"]["verified"]["max_abs_logit_diff"] == 0
    assert report["stages"][0]["result"]["achieved_sparsity"] == 0.5


def test_magnitude_sparse_bitmask_round_trips(flat_dir, tmp_path):
    res = _run(flat_dir, tmp_path / "dense", "prune", "--sparsity", "0.3")
    assert res.exit_code == 0, res.output
    res = _run(flat_dir, tmp_path / "ct", "prune", "--sparsity", "0.3", "--format", "compressed-tensors")
    assert res.exit_code == 0, res.output
    dense, ct = _weights(tmp_path / "dense"), _weights(tmp_path / "ct")
    for n in LINEARS:
        assert torch.equal(dense[n], ct[n])


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "dense"])
def test_rtn_whole_model(flat_dir, tmp_path, fmt):
    from geminicompress.core.grid import QuantSpec, rtn_quantize

    out = tmp_path / fmt
    res = _run(flat_dir, out, "quantize", "--method", "rtn", "--bits", "4", "--group-size", "32", "--format", fmt)
    assert res.exit_code == 0, res.output
    base, got = _weights(flat_dir), _weights(out)
    for n in LINEARS:
        qw = rtn_quantize(base[n], QuantSpec(4, 32, True))
        if fmt == "gptq":
            qw.scales = qw.scales.half().float()  # the format stores fp16 scales; the run rounds on them
        assert torch.allclose(got[n], qw.dequantize(), atol=1e-6), n  # the same RTN as the layer walk's
        err = float((got[n] - base[n]).norm() / base[n].norm())
        assert 0.02 < err < 0.2, (n, err)  # 4-bit g32 of a Gaussian: ~0.1
    assert torch.equal(got["lm_head"], base["lm_head"])  # default ignore
    assert 0 < _logit_error(got["_model"], base["_model"]) < 0.2


@torch.no_grad()
def _effective_weight(module: nn.Module) -> torch.Tensor:
    """(out, in): the dequantized weight of an INT8 module, else what a linear-like module multiplies by (its
    response to the identity, less its bias: int8 is read back as pack-quantized 8-bit, a dequantizing linear)."""
    if hasattr(type(module), "dequantized_weight"):
        return module.dequantized_weight()
    eye = torch.eye(module.in_features)
    return (module(eye) - module(torch.zeros_like(eye))).T


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_int8_whole_model(flat_dir, tmp_path, method):
    out = tmp_path / method
    extra = ["--smoothquant-alpha", "0"] if method == "w8a8" else []
    res = _run(flat_dir, out, "quantize", "--method", method, *extra)
    assert res.exit_code == 0, res.output
    from geminicompress.models.loading import load_model

    base, got = load_model(str(flat_dir)).model, load_model(str(out)).model
    kinds = {n: type(m).__name__ for n, m in got.named_modules() if n in (*LINEARS, "lm_head")}
    assert kinds["lm_head"] == "Linear" and all(kinds[n] != "Linear" for n in LINEARS), kinds
    for n in LINEARS:
        w, w_hat = base.get_submodule(n).weight, _effective_weight(got.get_submodule(n))
        w = w.detach()
        assert 0 < float((w_hat - w).norm() / w.norm()) < 0.01  # per-channel int8: ~0.4 %
    assert 0 < _logit_error(got, base) < (0.02 if method == "int8" else 0.1)


@pytest.mark.parametrize("args,needs", [
    (["quantize", "--method", "gptq"], "each decoder layer's inputs"),
    (["quantize", "--method", "awq"], "norm -> linear feeds"),
    (["quantize", "--method", "w8a8"], "SmoothQuant"),
    (["prune", "--method", "wanda"], "each decoder layer's inputs"),
    (["prune", "--method", "sparsegpt"], "each decoder layer's inputs"),
    (["prune", "--stream"], "run it without --stream"),
    (["quantize", "--method", "rtn", "--stream"], "run it without --stream"),
])
def test_refused_in_one_line(flat_dir, tmp_path, args, needs):
    out = tmp_path / "o"
    res = _run(flat_dir, out, *args)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1 and needs in line and "rtn and int8" in line, line
    assert not out.exists()
