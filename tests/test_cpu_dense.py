"""kernels/cpu_dense.py: each route gives torch's linear to float rounding; a float32 CPU input without gradient
is routed by its rows, anything else keeps torch's own route bit for bit; a model's linears turn in place (tied
weights stay tied) and its logits stay torch's to rounding."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from geminicompress.kernels import cpu_dense as cd
from geminicompress.kernels.cpu_dense import FEW_ROWS_MAX, CpuDenseLinear, cpu_dense, few_rows_linear, onednn_linear


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    return float((got.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(3, 64), (2, 2, 64), (1, 5, 64)])
def test_few_rows_linear_equals_linear(dtype, tol, shape):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(*shape, dtype=dtype)
    got = few_rows_linear(x, w, b)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype and got.is_contiguous()
    assert _close(got, F.linear(x, w, b), tol)


@pytest.mark.skipif(not cd.ONEDNN, reason="this torch build has no oneDNN linear on this CPU (the route is off)")
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (7, 64), (2, 300, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_linear(shape, bias):
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(*shape)
    b = torch.randn(96) if bias else None
    got = onednn_linear(x, w, b)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.float32
    assert _close(got, F.linear(x, w, b), 1e-5)


def _routes(monkeypatch) -> list[str]:
    """Record which route each call of a CpuDenseLinear takes."""
    seen: list[str] = []
    for name in ("few_rows_linear", "onednn_linear"):
        real = getattr(cd, name)
        monkeypatch.setattr(cd, name, lambda *a, _r=real, _n=name: (seen.append(_n), _r(*a))[1])
    monkeypatch.setattr(cd, "ONEDNN", True)
    monkeypatch.setattr(cd, "ONEDNN_MIN_WEIGHT", 32 * 48)  # the tests' small weights take the route
    return seen


def test_module_routes_by_rows(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    m = CpuDenseLinear(32, 48)
    m.load_state_dict(lin.state_dict())
    seen = _routes(monkeypatch)
    with torch.no_grad():
        for rows, route in [(1, "onednn_linear"), (2, "few_rows_linear"), (FEW_ROWS_MAX, "few_rows_linear"),
                            (FEW_ROWS_MAX + 1, "onednn_linear"), (64, "onednn_linear")]:
            x = torch.randn(1, rows, 32)
            assert _close(m(x), F.linear(x, lin.weight, lin.bias), 1e-5)
            assert seen.pop() == route and not seen, rows


def test_other_inputs_keep_torch_route(monkeypatch):
    torch.manual_seed(0)
    seen = _routes(monkeypatch)
    half = CpuDenseLinear(32, 48, dtype=torch.bfloat16)  # bf16: torch's route (faster there than (W·Xᵀ)ᵀ)
    few_bf16 = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(half(few_bf16), F.linear(few_bf16, half.weight, half.bias))
    m = CpuDenseLinear(32, 48)
    x = torch.randn(4, 32, requires_grad=True)
    y = m(x)  # a gradient asked: torch's route, differentiable
    assert torch.equal(y, F.linear(x, m.weight, m.bias))
    y.sum().backward()
    assert torch.allclose(x.grad, m.weight.sum(0).expand(4, -1), atol=1e-5)
    m.weight.data = torch.randn(32, 48).t()  # a weight not stored row-major: torch's route
    with torch.no_grad():
        assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    assert seen == []


def test_without_onednn_one_row_keeps_torch_route(monkeypatch):
    monkeypatch.setattr(cd, "ONEDNN", False)
    m = CpuDenseLinear(32, 48)
    with torch.no_grad():
        for rows in (1, FEW_ROWS_MAX + 1):
            x = torch.randn(rows, 32)
            assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_a_weight_that_stays_in_cache_keeps_torch_route(monkeypatch):
    seen = _routes(monkeypatch)
    monkeypatch.setattr(cd, "ONEDNN_MIN_WEIGHT", 32 * 48 + 1)  # one element more than the weight below
    m = CpuDenseLinear(32, 48)
    with torch.no_grad():
        for rows in (1, FEW_ROWS_MAX + 1):
            x = torch.randn(rows, 32)
            assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    assert seen == []


def test_model_in_place_keeps_ties_and_logits(monkeypatch):
    monkeypatch.setattr(cd, "ROUTED", True)  # as on an AMD CPU, whatever this one is
    monkeypatch.setattr(cd, "ONEDNN_MIN_WEIGHT", 0)  # this tiny model's weights take oneDNN's route too
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        ids = {n: torch.randint(0, 300, (1, n)) for n in (1, 3, 9)}  # one route each
        before = {n: model(x).logits for n, x in ids.items()}
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        assert cpu_dense(model) == n_linear == 2 * 7 + 1
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(type(m) is not nn.Linear for m in model.modules())
        for n, x in ids.items():
            assert float((model(x).logits - before[n]).abs().max()) < 1e-4


def test_fast_kernels_route_dense_cpu_models_reference_does_not(monkeypatch):
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    monkeypatch.setattr(cd, "ROUTED", True)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    fast, ref = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    first = use_fast_kernels(fast, torch.device("cpu"))
    assert first.kernel == "dense"
    assert use_fast_kernels(fast, torch.device("cpu")) == first  # asked again: the same answer, nothing counted twice
    assert use_fast_kernels(ref, torch.device("cpu"), reference=True).kernel == "dense"
    assert sum(type(m) is CpuDenseLinear for m in fast.modules()) == 8
    assert sum(type(m) is CpuDenseLinear for m in ref.modules()) == 0


def test_a_cpu_where_the_routes_are_slower_keeps_torch_linear(monkeypatch):
    """On a CPU other than AMD's (an Intel Xeon: a demo decode step 43.9 ms routed against 30.2) the model is
    left as it is: the fast kernels change no linear."""
    from geminicompress.eval.engines.torch_kernels import use_fast_kernels

    monkeypatch.setattr(cd, "ROUTED", False)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    assert cpu_dense(model) == 0 and use_fast_kernels(model, torch.device("cpu")).kernel == "dense"
    assert sum(type(m) is nn.Linear for m in model.modules()) == 8


@pytest.mark.parametrize("text, amd", [("vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n", True),
                                       ("vendor_id\t: GenuineIntel\n", False), ("processor\t: 0\n", False)])
def test_the_vendor_is_read_from_cpuinfo(tmp_path, text, amd):
    from geminicompress.kernels.cpu_vendor import cpu_vendor

    (tmp_path / "cpuinfo").write_text(text)
    assert (cpu_vendor(tmp_path / "cpuinfo") == "AuthenticAMD") is amd
    assert cpu_vendor(tmp_path / "missing") == ""
