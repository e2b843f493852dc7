"""kernels/decode_attention.py: one bfloat16 query token per sequence is computed as a float32 matmul-softmax that
agrees with torch's sdpa to bfloat16 rounding, masks included; every other call is transformers' sdpa itself;
a bf16 model's fast kernels switch to it and serving rows keep it when they ask for sdpa."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from geminicompress.kernels import decode_attention as da


def _qkv(b, h, kv, n, length, dtype=torch.bfloat16, d=16):
    g = torch.Generator().manual_seed(b * 100 + n)
    return (torch.randn(b, h, n, d, generator=g).to(dtype), torch.randn(b, kv, length, d, generator=g).to(dtype),
            torch.randn(b, kv, length, d, generator=g).to(dtype))


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _reference(q, k, v, mask):
    """sdpa in float32 with the KV heads repeated for their query heads: (B, Q, H, D)."""
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1),
        attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.float()))
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_one_token_matches_sdpa_to_bf16_rounding(mask_kind):
    q, k, v = _qkv(2, 6, 2, 1, 37)
    mask = None
    if mask_kind:  # the second sequence is left-padded by 5 positions
        keep = torch.ones(2, 1, 1, 37, dtype=torch.bool)
        keep[1, ..., :5] = False
        mask = keep if mask_kind == "bool" else torch.zeros(2, 1, 1, 37).masked_fill(~keep, -1e30)
    got, none = da.decode_attention(_Attn(), q, k, v, mask)
    ref = _reference(q, k, v, mask)
    assert none is None and got.shape == (2, 1, 6, 16) and got.dtype == torch.bfloat16
    assert float((got.float() - ref).abs().max()) <= 1e-2 * float(ref.abs().max())
    if mask_kind:  # the padded positions count for nothing: the same as attending to the rest only
        alone, _ = da.decode_attention(_Attn(), q[1:], k[1:, :, 5:], v[1:, :, 5:], None)
        assert torch.equal(got[1:], alone)


def test_other_calls_are_transformers_sdpa(monkeypatch):
    seen = []
    monkeypatch.setattr(da, "_sdpa_forward", lambda: lambda *a, **k: seen.append(a[1].shape) or ("sdpa", None))
    module = _Attn()
    for q, k, v in (_qkv(1, 6, 2, 3, 20),  # three query tokens (a prefill, a verification)
                    _qkv(1, 6, 2, 1, 20, dtype=torch.float32)):  # float32: torch's kernel is as fast
        assert da.decode_attention(module, q, k, v, None)[0] == "sdpa"
    q, k, v = _qkv(1, 6, 2, 1, 20)
    assert da.decode_attention(module, q, k, v, None, dropout=0.1)[0] == "sdpa"
    assert da.decode_attention(module, q, k, v, None, softcap=30.0)[0] == "sdpa"
    assert len(seen) == 4


def _tiny(dtype):
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@torch.no_grad()
def test_model_decode_matches_sdpa_and_fast_kernels_switch_bf16_only(monkeypatch):
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    monkeypatch.setattr(da, "FASTER_HERE", True)  # as on an AMD CPU, whatever this one is
    model, same = _tiny(torch.bfloat16), _tiny(torch.bfloat16)
    assert use_fast_kernels(model, torch.device("cpu")).activation_dtype == "bfloat16"
    assert model.config._attn_implementation == da.NAME and same.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # padded on the left, as a batch of unequal prompts
    logits = []
    for m in (model, same):
        out = m(ids, attention_mask=mask[:, :9], use_cache=True)
        step = m(ids[:, -1:], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        logits.append(step.logits.float())
    assert float((logits[0] - logits[1]).abs().max()) <= 2e-2 * float(logits[1].abs().max())
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    fp32 = _tiny(torch.float32)
    use_fast_kernels(fp32, torch.device("cpu"))
    assert fp32.config._attn_implementation == "sdpa"  # float32: torch's kernel, untouched
    assert da.attention_name(model, "sdpa") == da.NAME and da.attention_name(model, "eager") == "eager"
    assert da.attention_name(fp32, "sdpa") == "sdpa"


@torch.no_grad()
def test_a_bf16_model_on_eager_can_take_it_when_a_row_asks_for_sdpa(monkeypatch):
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    monkeypatch.setattr(da, "FASTER_HERE", True)
    model = _tiny(torch.bfloat16)
    model.set_attn_implementation("eager")
    use_fast_kernels(model, torch.device("cpu"))
    assert model.config._attn_implementation == "eager"  # eager stays eager
    model.set_attn_implementation(da.attention_name(model, "sdpa"))  # what a serving row does
    assert model.config._attn_implementation == da.NAME
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2))
    out = model(ids, use_cache=True)
    step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    assert step.logits.shape == (1, 1, 300) and bool(torch.isfinite(step.logits).all())


def test_a_cpu_where_torchs_kernel_is_faster_keeps_sdpa(monkeypatch):
    """On a CPU other than AMD's (an Intel Xeon: torch's kernel 28 µs against 63 at 300 positions) a bf16 model
    keeps transformers' sdpa, and a serving row that asks for sdpa gets sdpa."""
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    monkeypatch.setattr(da, "FASTER_HERE", False)
    model = _tiny(torch.bfloat16)
    use_fast_kernels(model, torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa" and da.attention_name(model, "sdpa") == "sdpa"
