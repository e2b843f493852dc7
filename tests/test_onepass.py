"""One-pass sequential calibration: each group is solved from inputs through the already-solved groups,
every batch runs once, results equal the per-group passes exactly, and errors leave no thread behind."""

import threading

import pytest
import torch
import torch.nn as nn
from tiny import tiny_model

from geminicompress.core.arch import arch_for, decoder_layers
from geminicompress.engine.layers import LayerJob, capture_inputs, forward_layer
from geminicompress.engine.onepass import one_pass
from geminicompress.core.errors import GeminiError
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 4, bias=False))


def test_each_group_sees_inputs_through_the_solved_groups_and_outputs_are_the_solved_model():
    net = _chain()
    batches = [torch.randn(3, 6) for _ in range(4)]
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def solve(g):  # a modification the next group's inputs must reflect
        net[2 * g].weight.data.mul_(-2.0)

    out = one_pass(net, batches, [[net[0]], [net[2]]], lambda g, x: seen[g].append(x.clone()), solve)
    with torch.no_grad():
        for b, x0, x1, y in zip(batches, seen[0], seen[1], out):
            torch.testing.assert_close(x0, b)  # group 0 saw the original input
            torch.testing.assert_close(x1, torch.relu(net[0](b)))  # group 1 saw the *solved* group 0
            torch.testing.assert_close(y, net(b))  # outputs: the fully solved model
    assert not torch.is_grad_enabled() or all(not y.requires_grad for y in out)


def test_solve_runs_once_per_group_after_every_batch_was_observed():
    net = _chain()
    log = []
    one_pass(net, [torch.randn(2, 6) for _ in range(3)], [[net[0]], [net[2]]],
             lambda g, x: log.append(("observe", g)), lambda g: log.append(("solve", g)))
    assert log == [("observe", 0)] * 3 + [("solve", 0)] + [("observe", 1)] * 3 + [("solve", 1)]


def test_an_error_in_solve_propagates_and_leaves_no_thread():
    net = _chain()
    before = threading.active_count()

    def solve(g):
        if g == 1:
            raise GeminiError("boom")

    with pytest.raises(GeminiError, match="boom"):
        one_pass(net, [torch.randn(2, 6) for _ in range(3)], [[net[0]], [net[2]]], lambda g, x: None, solve)
    assert threading.active_count() == before


def test_an_unused_group_is_an_error():
    net = _chain()
    unused = nn.Linear(6, 6)
    with pytest.raises(GeminiError, match="never used"):
        one_pass(net, [torch.randn(2, 6)], [[net[0]], [unused]], lambda g, x: None, lambda g: None)


def test_layer_outputs_from_one_pass_match_a_forward_of_the_modified_layer():
    model = tiny_model("llama")
    inputs = capture_inputs(model, torch.randint(0, 384, (5, 16)), CPU)
    arch = arch_for(model)
    layer = decoder_layers(model)[0]
    job = LayerJob(0, layer, inputs, CPU, arch)
    groups = [list(g) for g in arch.sequential]
    job.one_pass(groups, lambda g, x: None, lambda g: [job.module(n).weight.data.mul_(0.9) for n in groups[g]], batch=2)
    ref = forward_layer(layer, inputs, CPU)
    assert len(job.outputs) == 5
    for a, b in zip(job.outputs, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("stage", [
    {"type": "quantize", "method": "gptq", "bits": 3, "group_size": 32, "act_order": True},
    {"type": "prune", "method": "sparsegpt", "sparsity": 0.5},
])
def test_one_pass_equals_the_per_group_passes(tiny_dir, text_file, tmp_path, stage):
    """GPTQ: one pass and --multi-pass give the same weights (same math, same batches). SparseGPT: the
    one-pass true-sequential result differs from pruning every group from the dense layer."""
    weights = []
    variants = ([{"one_pass": True}, {"one_pass": False}] if stage["type"] == "quantize"
                else [{"true_sequential": True}, {"true_sequential": False}])
    for i, extra in enumerate(variants):
        recipe = recipe_from_stage(str(tiny_dir), {**stage, **extra}, {"data": str(text_file), "samples": 6, "seq_len": 64},
                                   "test")
        loaded = load_model(str(tiny_dir))
        run_recipe(recipe, tmp_path / f"out{i}", RunOptions(device=CPU), loaded=loaded)
        weights.append({n: p.detach().clone() for n, p in loaded.model.named_parameters()})
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    if stage["type"] == "quantize":
        for name in weights[0]:
            torch.testing.assert_close(weights[0][name], weights[1][name], atol=1e-6, rtol=0)
    else:
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        torch.testing.assert_close(weights[0][q_proj], weights[1][q_proj])  # first group: same inputs
        assert not torch.equal(weights[0][o_proj], weights[1][o_proj])  # later groups: pruned inputs
