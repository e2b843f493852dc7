"""The layer-streamed forward (engine/forward.py): the same logits as the model's own forward, from a
model in memory and from a checkpoint read one layer at a time, activations in memory or on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from geminicompress.engine.forward import final_hidden, head_logits, streamed_logits
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers


def _windows(n: int = 5, T: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n, T), generator=g)


def _all_logits(source, windows, **kw) -> torch.Tensor:
    parts = dict(streamed_logits(source, windows, device=torch.device("cpu"), **kw))
    return torch.cat([parts[k] for k in sorted(parts)])


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt_neox", "qwen3"])
def test_in_memory_model_logits_equal_its_forward(kind):
    model = tiny_model(kind, num_hidden_layers=3)
    windows = _windows()
    with torch.no_grad():
        expected = torch.cat([model(w.unsqueeze(0), use_cache=False).logits for w in windows])
    got = _all_logits(model, windows)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the model is left as it was: its layers are back and its forward still works the same
    with torch.no_grad():
        again = model(windows[:1], use_cache=False).logits
    torch.testing.assert_close(again, expected[:1], rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_lazy_checkpoint_logits_equal_the_loaded_model(tmp_path: Path, tied: bool):
    model = tiny_model(num_hidden_layers=3, tie_word_embeddings=tied).to(torch.bfloat16)
    path = tmp_path / "m"
    model.save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    windows = _windows()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # as a user loads it
    with torch.no_grad():
        expected = torch.cat([reference(w.unsqueeze(0), use_cache=False).logits for w in windows])
    ckpt = LazyCheckpoint(path)
    got = _all_logits(LazyLayers(ckpt, torch.float32), windows, spill_dir=tmp_path)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # every weight went back to the meta device; the activation files are gone
    assert all(p.is_meta for p in ckpt.model.parameters())
    assert not list(tmp_path.glob("activations-*.bin"))


def test_spilled_activations_equal_in_memory_ones(tmp_path: Path):
    model = tiny_model(num_hidden_layers=2)
    windows = _windows(n=6)
    cpu = torch.device("cpu")
    a = final_hidden(model, windows, device=cpu)
    b = final_hidden(model, windows, device=cpu, spill_dir=tmp_path)
    assert b.store.path is not None and b.store.path.stat().st_size == a.tensor.numel() * 4
    torch.testing.assert_close(a.tensor, b.tensor, rtol=0, atol=0)
    # a batch of two windows in the head gives the same logits as one window at a time
    one = torch.cat([x for _, x in head_logits(model, a, device=cpu, batch=1)])
    two = torch.cat([x for _, x in head_logits(model, a, device=cpu, batch=2)])
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)
    a.close()
    b.close()
    assert not b.store.path.exists()
