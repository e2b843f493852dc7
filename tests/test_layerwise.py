"""The shared layer-by-layer machinery: exact activations, modifications propagate, resume restores."""

import pytest
import torch
from tiny import tiny_model

from geminicompress.core.arch import arch_for, decoder_layers
from geminicompress.engine.layers import capture_inputs, forward_layer
from geminicompress.engine.walk import WalkOptions, run_layerwise
from geminicompress.core.errors import InputError

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma", "gpt_neox"])
def test_layer_by_layer_matches_full_forward(kind):
    model = tiny_model(kind)
    windows = torch.randint(0, 384, (3, 24))
    inputs = capture_inputs(model, windows, CPU)
    for layer in decoder_layers(model):
        inputs.hidden = forward_layer(layer, inputs, CPU)
    with torch.no_grad():
        ref = model(windows, output_hidden_states=True).hidden_states
    # hidden_states[-1] has the final norm applied; compare with the pre-norm stream via the norm
    norm = model.gpt_neox.final_layer_norm if kind == "gpt_neox" else model.model.norm
    got = torch.cat([norm(h) for h in inputs.hidden])
    torch.testing.assert_close(got, ref[-1], atol=1e-5, rtol=1e-5)


def test_modifications_feed_the_next_layer_and_resume(tmp_path):
    windows = torch.randint(0, 384, (2, 16))
    calls = []

    def halve(job):
        calls.append(job.index)
        for name in job.arch.linears:
            job.module(name).weight.data *= 0.5
        return {"err": float(job.index)}, {"marker": torch.tensor([job.index])}

    a = tiny_model()
    walked = run_layerwise(a, windows, halve, WalkOptions(device=CPU, state_dir=tmp_path))
    summaries, kept = walked.summaries, walked.kept
    assert calls == [0, 1]
    assert [s["err"] for s in summaries] == [0.0, 1.0]
    assert kept["1.marker"].item() == 1
    # a fresh run over the same state directory restores both layers instead of processing them
    calls.clear()
    b = tiny_model()
    walked = run_layerwise(b, windows, halve, WalkOptions(device=CPU, state_dir=tmp_path))
    summaries, kept = walked.summaries, walked.kept
    assert calls == [] and all(s["resumed"] for s in summaries)
    assert kept["0.marker"].item() == 0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    ref = tiny_model()
    assert torch.allclose(b.model.layers[0].mlp.up_proj.weight, 0.5 * ref.model.layers[0].mlp.up_proj.weight)


def test_a_model_without_decoder_layers_is_refused_in_one_line():
    class NoLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = tiny_model().config
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(InputError, match="no decoder layers found"):
        arch_for(NoLayers())


def test_computing_in_runs_bf16_and_hands_back_the_float32_masters():
    from geminicompress.engine.layers import computing_in

    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    original = layer[0].weight.data.clone()
    exact = torch.full((8, 8), 1 / 3)  # not representable in bf16
    with computing_in(layer, torch.bfloat16) as master:
        assert layer[0].weight.dtype == torch.bfloat16 and layer(torch.ones(1, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
        torch.testing.assert_close(master["0.weight"], original, atol=0, rtol=0)
        master["0.weight"].copy_(exact)
    assert layer[0].weight.dtype == torch.float32 and torch.equal(layer[0].weight.data, exact)
    with computing_in(layer, torch.float32) as master:
        assert master is None


def test_hessian_from_bf16_inputs_equals_float32_products():
    from geminicompress.compress.hessian import HessianAccumulator

    x = torch.randn(4, 256, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    f32, b16 = HessianAccumulator(48), HessianAccumulator(48)
    for batch in x:
        f32.add_batch(batch.float())
        b16.add_batch(batch)
    assert b16.H.dtype == torch.float32
    torch.testing.assert_close(b16.H, f32.H, atol=0, rtol=0)  # bf16 values are exact in float32


def test_activation_storage_keeps_activations_on_the_gpu_only_when_they_fit(monkeypatch):
    from geminicompress.engine.walk import activation_storage

    windows = torch.zeros(32, 512, dtype=torch.long)
    cuda = torch.device("cuda")
    need = 2 * 32 * 512 * 4096 * 2  # inputs and outputs, bf16: 256 MiB
    assert activation_storage(windows, 4096, torch.bfloat16, torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * need, 8 * need))
    assert activation_storage(windows, 4096, torch.bfloat16, cuda) == cuda
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * need - 1, 8 * need))
    assert activation_storage(windows, 4096, torch.bfloat16, cuda) == torch.device("cpu")
