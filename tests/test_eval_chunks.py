"""Scoring positions in chunks (models/head.py) gives the figures of whole-window scoring: perplexity,
KL, top-1 agreement (cached baseline and recomputed), `perplexity()`, the head through the model's own
forward (Gemma 2's logit soft-capping), on a tiny model with a big vocabulary and chunks of a few rows."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

from geminicompress.core.metrics import DriftMeter
from geminicompress.eval.quality.baseline_cache import BaselineCache
from geminicompress.eval.quality.perplexity import perplexity, window_logprobs
from geminicompress.eval.quality.scoring import measure_quality
from geminicompress.models import head as head_mod
from geminicompress.models.head import chunk_rows, final_states, window_chunks

CPU = torch.device("cpu")
VOCAB = 5000
ROWS = 7  # positions per chunk: windows of 40 scored positions end in a short chunk


def _big_vocab(kind: str = "llama", seed: int = 0, **overrides):
    return tiny_model(kind, seed, vocab_size=VOCAB, **overrides)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(head_mod, "CHUNK_BYTES", ROWS * 4 * VOCAB)
    monkeypatch.setattr(head_mod.chunk_rows, "__defaults__", (ROWS * 4 * VOCAB,))


@pytest.fixture
def windows():
    return torch.randint(0, VOCAB, (3, 41), generator=torch.Generator().manual_seed(1))  # (3, 41)


def _whole(model, windows, base=None):
    """The unchunked figures: each window's (T-1, V) log-probs at once."""
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for i, w in enumerate(windows):
        logp = window_logprobs(model, w, CPU)
        nll -= float(logp.gather(-1, w[1:].view(-1, 1)).double().sum())
        if base is not None:
            b = window_logprobs(base, w, CPU)
            kl += float((b.exp() * (b - logp)).sum(-1).double().sum())
            agree += int((b.argmax(-1) == logp.argmax(-1)).sum())
        count += logp.shape[0]
    return math.exp(nll / count), kl / count, agree / count


def test_chunks_cover_the_window_with_the_whole_window_log_probs(windows):
    model = _big_vocab()
    assert chunk_rows(VOCAB) == ROWS
    parts = list(window_chunks(model, windows[0], CPU))
    assert [p.shape[0] for p in parts] == [7, 7, 7, 7, 7, 5]
    torch.testing.assert_close(torch.cat(parts), window_logprobs(model, windows[0], CPU), rtol=0, atol=1e-5)


@pytest.mark.parametrize("stored", [True, False])
def test_chunked_quality_equals_whole_window_figures(windows, stored):
    base, other = _big_vocab(seed=0), _big_vocab(seed=1)
    ppl, kl, agree = _whole(other, windows, base)
    with BaselineCache(3, 40, VOCAB, limit_bytes=1 << 40 if stored else 0) as cache:
        cache.model, cache.device = base, CPU
        b = measure_quality(base, windows, CPU, label="b", store=cache)
        got = measure_quality(other, windows, CPU, label="m", against=cache, base_ppl=b["perplexity"])
    assert cache.stored is stored
    assert b["perplexity"] == pytest.approx(_whole(base, windows)[0], rel=1e-6)
    assert got["perplexity"] == pytest.approx(ppl, rel=1e-6)
    assert got["kl_to_baseline"] == pytest.approx(kl, rel=1e-5) and kl > 0.01
    assert got["top1_agreement"] == pytest.approx(agree, abs=1e-9)
    assert (got["tokens"], got["windows"]) == (120, 3)


def test_perplexity_keeps_its_batches_and_equals_the_whole_window_value(windows):
    model = _big_vocab()
    want = _whole(model, windows)[0]
    for batch in (1, 2, 4):
        assert perplexity(model, windows, CPU, batch_size=batch) == pytest.approx(want, rel=1e-6)


def test_the_head_is_the_models_own_soft_capped_head(windows):
    model = _big_vocab("gemma2", num_key_value_heads=2, head_dim=16, final_logit_softcapping=1.0)
    hidden = final_states(model, windows[:1])[0]
    with torch.no_grad():
        want = model(windows[:1]).logits[0]  # capped at +-1
        plain = model.lm_head(hidden)
    parts = torch.cat([lp for lp in window_chunks(model, windows[0], CPU)])
    torch.testing.assert_close(parts, F.log_softmax(want[:-1].float(), -1), rtol=0, atol=1e-5)
    assert want.abs().max() < 1 and plain.abs().max() > 1.5  # the cap is applied, by the model's own forward


def test_drift_meter_sums_chunks_like_a_whole_window(windows):
    a, b = _big_vocab(seed=0), _big_vocab(seed=2)
    whole, parts = DriftMeter(), DriftMeter()
    whole.add(window_logprobs(a, windows[0], CPU), window_logprobs(b, windows[0], CPU))
    for x, y in zip(window_chunks(a, windows[0], CPU), window_chunks(b, windows[0], CPU)):
        parts.add(x, y)
    assert parts.kl == pytest.approx(whole.kl, rel=1e-5) and parts.agreement == whole.agreement


@pytest.mark.parametrize("keep_bytes", [0, 1 << 40])  # the original's log-probs recomputed / kept
def test_sensitivity_kl_in_chunks_equals_whole(monkeypatch, windows, keep_bytes):
    from geminicompress.compress.sensitivity import measure
    from geminicompress.compress.sensitivity.options import parse_options
    from geminicompress.compress.targets import decoder_linears as quantizable
    from geminicompress.core.arch import arch_for

    model = _big_vocab()
    keep = {n for n in quantizable(model, arch_for(model), []) if "layers.1.mlp" in n}
    options = parse_options("rtn:b2g16")

    def table():
        return measure.measure_sensitivity(model, windows[:2], options, measure.SensitivitySettings(keep=keep,
                                                                                                    measure="kl",
                                                                                                    kl_windows=2))

    monkeypatch.setattr(measure._Tail, "KEEP_BYTES", keep_bytes)
    chunked = table()
    monkeypatch.setattr(head_mod.chunk_rows, "__defaults__", (1 << 40,))  # one chunk: the whole (kw·(T−1), V)
    whole = table()
    got, want = [u["kl"][0] for u in chunked["units"]], [u["kl"][0] for u in whole["units"]]
    assert len(got) == 3 and min(want) > 1e-4
    assert got == pytest.approx(want, rel=1e-5)


def test_topk_cache_in_chunks_equals_the_whole_logits_top_k(windows, tmp_path):
    from geminicompress.distill.topk_cache import build_topk_cache, top_k

    model = _big_vocab()
    cache = build_topk_cache(model, windows, 5, CPU, batch_size=2, root=tmp_path)
    with torch.no_grad():
        v, i = top_k(model(windows).logits, 5)  # (3, 41, 5) each
    torch.testing.assert_close(cache.values, v, rtol=0, atol=1e-3)
    assert torch.equal(cache.indices, i)
