"""Sibling INT8 linears reading one input (q/k/v, gate/up) run as one GEMM at run time
(kernels/shared_input.py): same outputs as the separate GEMMs, fewer kernel calls."""

import copy

import pytest
import torch
from tiny import tiny_model

from geminicompress.core.arch import set_module
from geminicompress.kernels.int8 import MODULES
from geminicompress.kernels.shared_input import share_inputs


def _int8_model(method: str, kind: str = "llama"):
    model = tiny_model(kind).eval()
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            set_module(model, name, MODULES[method].from_linear(module))
    return model


@pytest.mark.parametrize("method", ["w8a8", "int8"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_shared_input_gives_the_separate_gemms_outputs(method, tokens, mode):
    separate = _int8_model(method)
    shared = copy.deepcopy(separate)
    groups = share_inputs(shared)
    layers = len(shared.model.layers)
    assert groups == 2 * layers  # q/k/v and gate/up in every layer
    ids = torch.randint(0, 384, (2, tokens), generator=torch.Generator().manual_seed(0))
    with mode():
        want, got = separate(ids).logits, shared(ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_fused_gemm_is_called_once_per_group_and_input():
    model = _int8_model("w8a8")
    share_inputs(model)
    fused_calls = []
    attn = model.model.layers[0].self_attn
    shared = attn.q_proj.shared[0]
    x = torch.randn(1, 1, attn.q_proj.in_features)
    real_build = shared._build

    def counting_build():
        fused = real_build()
        orig_forward = fused.forward
        fused.forward = lambda inp: (fused_calls.append(1), orig_forward(inp))[1]
        return fused

    shared._build = counting_build
    with torch.no_grad():
        _, k, _ = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        assert len(fused_calls) == 1
        x.add_(1.0)  # modified in place: the kept outputs must not be served
        attn.q_proj(x)
        k2 = attn.k_proj(x)
    assert len(fused_calls) == 2
    assert not torch.equal(k2, k)
    with torch.no_grad():
        attn.k_proj.shared = None  # alone: its own GEMM on the modified input
        assert torch.allclose(attn.k_proj(x), k2, atol=1e-5)


def test_new_weights_rebuild_the_fused_gemm():
    model = _int8_model("w8a8")
    share_inputs(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 3, mlp.gate_proj.in_features)
    with torch.no_grad():
        before = mlp.up_proj(x)
        mlp.gate_proj(x)
        state = {k: v.clone() for k, v in mlp.up_proj.state_dict().items()}
        state["weight"] = -state["weight"]
        mlp.up_proj.load_state_dict(state)
        after = mlp.up_proj(x)
    assert torch.allclose(after, -before, atol=1e-4)
