"""Lower-precision head and embeddings computed in float32 without a float32 copy of their weights
(engine/outside_float32.py): the float32 modules' outputs, and the streamed paths use them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny import save_sharded

from geminicompress.engine import outside_float32
from geminicompress.engine.forward import final_hidden, head_logits
from geminicompress.engine.outside_float32 import Float32Gather, Float32Rows
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers

CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [False, True])
def test_blocks_of_rows_give_the_float32_linears_logits(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 1000, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, 5, 48)
    rows = Float32Rows(linear, block_bytes=4 * 48 * 7)  # 7 rows a block: 143 blocks, the last one of 6
    assert rows.rows == 7
    got = rows(x)
    want = F.linear(x, linear.weight.float(), None if linear.bias is None else linear.bias.float())
    assert got.dtype == torch.float32 and got.shape == (2, 5, 1000)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(p.dtype == torch.bfloat16 for p in rows.parameters())  # the weights stay as stored


def test_gathered_rows_give_the_float32_embeddings_output():
    """A plain table with a padding index, and Gemma 3's scaled embedding (its forward multiplies in its weight's
    dtype: bfloat16 there, float32 here, as the float32 model does)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    torch.manual_seed(0)
    ids = torch.tensor([[5, 3, 5, 999], [0, 3, 7, 7]])
    for table in (nn.Embedding(1000, 16, padding_idx=999), Gemma3TextScaledWordEmbedding(1000, 16, 0, embed_scale=4.0)):
        table = table.to(torch.bfloat16)
        want = _float_copy(table)(ids)
        got = Float32Gather(table)(ids)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert table.weight.dtype == torch.bfloat16 and table.weight.shape == (1000, 16)  # put back as it was


def _float_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).float()


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("gemma3_text", True)])
def test_a_streamed_bfloat16_model_keeps_its_head_and_embeddings_as_stored(tmp_path: Path, monkeypatch, kind, tied):
    """final_hidden + head_logits over a checkpoint read one layer at a time, asked for float32: the embedding
    table and the head are held in bfloat16, the rows looked up and a few head rows at a time made float32, and
    the logits are those of the model loaded in float32."""
    extra = dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]) \
        if kind == "gemma3_text" else {}
    path = save_sharded(tmp_path / "m", num_hidden_layers=2, tie_word_embeddings=tied, kind=kind,
                        num_key_value_heads=2, **extra)
    monkeypatch.setattr(outside_float32, "BLOCK_BYTES", 4 * 64 * 5)  # tiny: hidden 64, 5 rows a block
    seen, gathered = [], []
    forward, gather = Float32Rows.forward, Float32Gather.forward
    monkeypatch.setattr(Float32Rows, "forward", lambda self, x: seen.append((self.rows, self.linear.weight.dtype))
                        or forward(self, x))
    monkeypatch.setattr(Float32Gather, "forward", lambda self, ids, *a, **k: gathered.append(
        (type(self.embedding).__name__, self.embedding.weight.dtype)) or gather(self, ids, *a, **k))
    windows = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    source = LazyLayers(LazyCheckpoint(path), torch.float32)
    hidden = final_hidden(source, windows, device=CPU)
    got = torch.cat([logits for _, logits in head_logits(source, hidden, device=CPU)])
    hidden.close()
    assert seen and all(s == (5, torch.bfloat16) for s in seen)
    assert gathered and all(dtype == torch.bfloat16 for _, dtype in gathered)
    assert gathered[0][0] == ("Gemma3TextScaledWordEmbedding" if kind == "gemma3_text" else "Embedding")
    assert all(p.is_meta for p in source.ckpt.model.parameters())  # read, used and released as before
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([reference(w.unsqueeze(0), use_cache=False).logits for w in windows])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_a_calibrated_streamed_walk_captures_layer_0_without_a_float32_table(tmp_path: Path, monkeypatch, kind):
    """A calibrated walk over a bfloat16 checkpoint read one layer at a time (GPTQ, SparseGPT, AWQ --stream)
    captures layer 0's inputs through the table as stored, only the rows looked up made float32: the same
    inputs, bit for bit, as the model loaded in float32 gives (it used to read the whole table in float32:
    4 GiB at 262,144 x 4,096, the peak of a streamed GPTQ run on such a vocabulary)."""
    from transformers import AutoModelForCausalLM

    from geminicompress.engine import walk
    from geminicompress.engine.layers import capture_inputs

    extra = dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]) \
        if kind == "gemma3_text" else {}
    path = save_sharded(tmp_path / "m", num_hidden_layers=2, kind=kind, num_key_value_heads=2, **extra)
    source = LazyLayers(LazyCheckpoint(path), torch.float32)
    embedding = next(n for n, m in source.model.named_modules() if m is source.model.get_input_embeddings())
    asked = []
    materialise = LazyCheckpoint.materialise
    monkeypatch.setattr(LazyCheckpoint, "materialise", lambda self, name, dtype=None:
                        asked.append((name, dtype)) or materialise(self, name, dtype))
    windows = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    got = walk._first_inputs(source, windows, CPU, None, None, check=False)
    assert asked == [(embedding, None)]  # read as stored, never whole in float32
    assert all(p.is_meta for p in source.ckpt.model.parameters())  # released
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = capture_inputs(reference, windows, CPU)
    assert len(got.hidden) == len(want.hidden) == 3
    for g, w in zip(got.hidden, want.hidden):
        assert g.dtype == torch.float32 and torch.equal(g, w)
