"""kernels/few_rows.py: the (W·Xᵀ)ᵀ route for a few rows gives torch's linear to float rounding, leaves one row and
many rows on torch's own route, and turns a model's linears in place (tied weights stay tied)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from geminicompress.kernels.few_rows import FEW_ROWS_MAX, FewRowsLinear, few_rows, few_rows_linear


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(3, 64), (2, 2, 64), (1, 5, 64)])
def test_few_rows_linear_equals_linear(dtype, tol, shape):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(*shape, dtype=dtype)
    ref = F.linear(x, w, b).float()
    got = few_rows_linear(x, w, b)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype and got.is_contiguous()
    assert float((got.float() - ref).abs().max()) <= tol * float(ref.abs().max())


def test_module_routes_by_rows():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    m = FewRowsLinear(32, 48)
    m.load_state_dict(lin.state_dict())
    one, many = torch.randn(1, 1, 32), torch.randn(FEW_ROWS_MAX + 1, 32)
    assert torch.equal(m(one), F.linear(one, lin.weight, lin.bias))  # one row: torch's own route, bit for bit
    assert torch.equal(m(many), F.linear(many, lin.weight, lin.bias))
    half = FewRowsLinear(32, 48, dtype=torch.bfloat16)  # bf16 keeps torch's route: faster there
    few_bf16 = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(half(few_bf16), F.linear(few_bf16, half.weight, half.bias))
    few = torch.randn(4, 32, requires_grad=True)
    m(few).sum().backward()  # differentiable like the linear
    assert torch.allclose(few.grad, lin.weight.sum(0).expand(4, -1), atol=1e-5)


def test_model_in_place_keeps_ties_and_logits():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        assert few_rows(model) == n_linear == 2 * 7 + 1
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(type(m) is not nn.Linear for m in model.modules())
        after = model(ids).logits  # 6 rows: the few-rows route in every linear
    assert float((after - before).abs().max()) < 1e-4


def test_fast_kernels_route_dense_cpu_models_reference_does_not():
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    fast, ref = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    first = use_fast_kernels(fast, torch.device("cpu"))
    assert first.kernel == "dense"
    assert use_fast_kernels(fast, torch.device("cpu")) == first  # asked again: the same answer, nothing counted twice
    assert use_fast_kernels(ref, torch.device("cpu"), reference=True).kernel == "dense"
    assert sum(type(m) is FewRowsLinear for m in fast.modules()) == 8
    assert sum(type(m) is FewRowsLinear for m in ref.modules()) == 0
