"""Eval math on the tiny in-process model: perplexity by hand, KL/agreement, percentiles, footprint."""

import math

import pytest
import torch
import torch.nn.functional as F

from geminicompress.core.metrics import DriftMeter, kl_per_token, top1_agreement
from geminicompress.data import pack_windows, tokenize
from geminicompress.eval.cost.footprint import count_params, weight_sparsity, weights_size_mb
from geminicompress.eval.cost.latency import LatencyOptions, greedy_run, measure_latency, percentile, prompt_batch
from geminicompress.eval.quality.baseline_cache import BaselineCache
from geminicompress.eval.quality.scoring import measure_quality

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture
def windows(tok, text_file):
    return pack_windows(tokenize(tok, text_file.read_text(), 6 * 64), 64)  # (6, 64)


def test_perplexity_is_exp_of_mean_loss_by_hand(model, windows):
    got = measure_quality(model, windows, CPU, label="m")
    losses, nll_sum, count = [], 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(w.view(1, -1)).logits[0]
            nll = F.cross_entropy(logits[:-1], w[1:], reduction="none")
            nll_sum, count = nll_sum + nll.double().sum().item(), count + nll.numel()
            losses.append(model(w.view(1, -1), labels=w.view(1, -1)).loss.item())
    assert got["tokens"] == count == 6 * 63 and got["windows"] == 6 and got["seq_len"] == 64
    assert got["perplexity"] == pytest.approx(math.exp(nll_sum / count), rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)  # the HF loop


@pytest.mark.parametrize("stored", [True, False])
def test_kl_of_a_model_against_itself_is_zero_and_agreement_one(model, windows, stored):
    with BaselineCache(windows.shape[0], 63, model.config.vocab_size, limit_bytes=1 << 40 if stored else 0) as cache:
        base = measure_quality(model, windows, CPU, label="b", store=cache)
        assert cache.stored == stored
        cache.model, cache.device = model, CPU  # used only when not stored (recompute)
        again = measure_quality(model, windows, CPU, label="m", against=cache, base_ppl=base["perplexity"])
    assert again["kl_to_baseline"] == pytest.approx(0.0, abs=1e-7)
    assert again["top1_agreement"] == 1.0
    assert again["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)


def test_cached_logprobs_round_trip_exactly(model, windows):
    from geminicompress.eval.quality.perplexity import window_logprobs

    with BaselineCache(windows.shape[0], 63, model.config.vocab_size) as cache:
        logps = [window_logprobs(model, w, CPU) for w in windows]
        for i, lp in enumerate(logps):
            cache.put(i, 0, lp[:40])
            cache.put(i, 40, lp[40:])
        for i in (3, 0, 5):
            assert torch.equal(cache.get(i, windows[i]), logps[i])
            assert torch.equal(cache.get(i, windows[i], 10, 50), logps[i][10:50])
        first = cache.get(1, windows[1], 0, 20)
        second = cache.get(2, windows[2], 0, 20)  # read into the same memory: a chunk lives until the next get
        assert first.data_ptr() == second.data_ptr() and torch.equal(first, logps[2][:20])


def test_kl_and_agreement_on_known_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.05, 0.05]]).log()
    q = torch.tensor([[0.25, 0.75, 0.0], [0.1, 0.8, 0.1]]).log()
    kl = kl_per_token(p, q)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-6)
    want1 = 0.9 * math.log(9) + 0.05 * math.log(0.05 / 0.8) + 0.05 * math.log(0.5)
    assert kl[1].item() == pytest.approx(want1, rel=1e-6)
    assert top1_agreement(p, q).tolist() == [False, False]  # tie in row 0 resolves to index 0; q says 1
    meter = DriftMeter()
    meter.add(p, q)
    meter.add(p, p)
    assert meter.tokens == 4 and meter.agreement == 0.5
    assert meter.kl == pytest.approx(kl.sum().item() / 4, rel=1e-6)


def test_kl_keeps_its_edge_cases_and_leaves_its_inputs_alone():
    """0 log 0 := 0 where the baseline gives a token no mass (even where the model gives it none either:
    -inf - -inf); infinite where the model gives no mass to a token the baseline gives some; the in-place
    arithmetic works on its own temporaries, not on the log-probs passed in."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]).log()
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]).log()
    p0, q0 = p.clone(), q.clone()
    kl = kl_per_token(p, q)
    assert kl[0].item() == 0.0 and kl[1].item() == math.inf
    assert torch.equal(p, p0) and torch.equal(q, q0)


def test_different_model_has_positive_kl(windows):
    from tiny import tiny_model

    a, b = tiny_model(seed=0), tiny_model(seed=1)
    with BaselineCache(windows.shape[0], 63, a.config.vocab_size) as cache:
        measure_quality(a, windows, CPU, label="a", store=cache)
        got = measure_quality(b, windows, CPU, label="b", against=cache)
    assert got["kl_to_baseline"] > 0.01 and got["top1_agreement"] < 1.0


def test_percentile_matches_linear_interpolation():
    samples = [float(x) for x in range(1, 11)]
    assert percentile(samples, 50) == pytest.approx(5.5)
    assert percentile(samples, 90) == pytest.approx(9.1)


def test_greedy_run_equals_transformers_generate(model, tok, text_file):
    prompt = prompt_batch(tokenize(tok, text_file.read_text(), 200), 2, 12)  # (2, 12)
    run = greedy_run(model, prompt, 6, CPU)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=6,
                         min_new_tokens=6, pad_token_id=0)
    assert torch.equal(run.generated, ref[:, 12:])
    assert run.prefill_s > 0 and run.decode_s > 0


def test_measure_latency_reports_every_batch_size(model, tok, text_file):
    ids = tokenize(tok, text_file.read_text(), 100)
    options = LatencyOptions(prompt_len=8, gen_len=3, batch_sizes=(2, 3), repeats=2, warmup=0)
    got = measure_latency(model, ids, options, device=CPU)
    assert set(got["throughput_tok_s"]) == {"2", "3"}
    assert got["ttft_ms"]["p90"] >= got["ttft_ms"]["median"] > 0
    assert got["tpot_ms"]["median"] > 0 and got["threads"] == torch.get_num_threads()


def test_prompt_batch_cuts_distinct_prompts_and_repeats_short_text():
    ids = torch.arange(10)
    assert prompt_batch(ids, 2, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert prompt_batch(ids, 3, 4).tolist()[2] == [8, 9, 0, 1]


def test_footprint_params_sparsity_size(model, tmp_path):
    assert count_params(model) == sum(p.numel() for p in model.parameters())
    assert weight_sparsity(model) == 0.0
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.zero_()
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    q = model.model.layers[0].self_attn.q_proj.weight.numel()
    assert weight_sparsity(model) == pytest.approx(q / sum(m.weight.numel() for m in linears), abs=1e-6)
    model.save_pretrained(tmp_path)
    assert weights_size_mb(tmp_path) == pytest.approx((tmp_path / "model.safetensors").stat().st_size / 2**20, abs=0.01)


def test_packed_linear_counts_its_logical_weights(model):
    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.in_features, self.out_features = 64, 64
            self.register_buffer("qweight", torch.zeros(8, 64, dtype=torch.int32))

    dense = count_params(model)
    model.model.layers[0].self_attn.q_proj = Packed()
    assert count_params(model) == dense  # 64*64 logical weights replace the 64*64 dense ones (no bias)
