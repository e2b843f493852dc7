"""The check's probe runs a finished layer as stored with each plain linear's float32 weights made just before
the linear runs (one linear's copy alive at a time, not the whole layer's): the same hidden states, bitwise,
as converting the whole layer first, and the layer keeps its own tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_model

from geminicompress.core.arch import decoder_layers, get_module
from geminicompress.engine.forward import embed, through_layer
from geminicompress.engine.layers import computing_in
from geminicompress.engine.verify import Probe, as_stored


def _whole_layer(layer, hidden, kwargs, out_dtype, exact):
    """The probe's step as it was written first: the whole layer in float32, rounded as stored, exact weights in."""
    with computing_in(layer, torch.float32):
        as_stored(layer, out_dtype, [f"{n}.weight" for n in exact])
        for name, make in exact.items():
            weight = get_module(layer, name).weight
            weight.data = make() if not weight.numel() else weight.data.copy_(make())
        through_layer(layer, hidden, hidden, kwargs, device=torch.device("cpu"), dtype=torch.float32, batch=1)


@pytest.mark.parametrize("kind,dtype,out_dtype", [("llama", torch.bfloat16, torch.bfloat16),
                                                  ("llama", torch.float32, torch.bfloat16),
                                                  ("gemma", torch.bfloat16, torch.bfloat16),
                                                  ("gpt_neox", torch.float32, torch.float32)])
def test_linears_made_on_call_give_the_whole_layer_result(kind, dtype, out_dtype):
    model = tiny_model(kind).to(dtype)
    windows = torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden = embed(model, windows, device=torch.device("cpu"))
    layer = decoder_layers(model)[0]
    names = [n for n, m in layer.named_modules() if type(m) is torch.nn.Linear]
    g = torch.Generator().manual_seed(1)
    made = {names[0]: get_module(layer, names[0]).weight.float() + 0.01 * torch.randn(get_module(layer, names[0]).weight.shape, generator=g),
            names[-1]: get_module(layer, names[-1]).weight.float() * 1.001}
    exact = {n: (lambda w=w: w.clone()) for n, w in made.items()}
    get_module(layer, names[-1]).weight.data = torch.empty(0, dtype=dtype)  # one the run dropped (stages.releaser)
    before = {n: (p.data.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()}

    original = copy.deepcopy(layer)
    reference = hidden.tensor.clone()
    _whole_layer(copy.deepcopy(layer), reference, hidden.layer_kwargs[0], out_dtype, exact)
    probe = Probe.__new__(Probe)
    probe.out_dtype, probe.device, probe.hidden = out_dtype, torch.device("cpu"), hidden
    probe.advance(0, layer, exact)

    assert torch.equal(hidden.tensor, reference)
    assert not torch.equal(reference, embed(model, windows, device=torch.device("cpu")).tensor)  # the layer ran
    if dtype == torch.float32:  # held in float32: rounded in place as stored, exact weights as made (as before)
        reference_layer = copy.deepcopy(original)
        _whole_layer(reference_layer, reference.clone(), hidden.layer_kwargs[0], out_dtype, exact)
        for (n, p), (_, r) in zip(layer.named_parameters(), reference_layer.named_parameters()):
            if n == f"{names[-1]}.weight":
                assert p.numel() == 0  # dropped by the run, dropped again (the probe releases it after)
            else:
                assert p.dtype == torch.float32 and torch.equal(p, r)
    else:
        assert {n: (p.data.data_ptr(), p.dtype, p.shape) for n, p in layer.named_parameters()} == before
