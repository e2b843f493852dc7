"""A compressed checkpoint read one decoder layer at a time (models/lazy.py + each format's ModuleReader)
computes the same logits as the same checkpoint loaded in memory by our loader, for every format this
project writes; bad quantized tensors fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny

from geminicompress.engine.forward import streamed_logits
from geminicompress.core.errors import InputError
from geminicompress.formats.dequant import DequantLinear
from geminicompress.models.headers import is_readable_dir
from geminicompress.models.lazy import LazyCheckpoint, LazyLayers
from geminicompress.models.loading import load_model
from geminicompress.runtime.pipeline import RunOptions, run_recipe
from geminicompress.runtime.recipes.loader import recipe_from_stage

CPU = torch.device("cpu")
V = "model.layers.0.self_attn.v_proj"

# name -> (stage, tiny-model overrides, output dtype)
CASES = {
    "gptq": ({"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16}, {}, "float32"),
    "gptq-bias-bf16": ({"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16}, {"kind": "qwen2"}, "bfloat16"),
    "gptq-mixed": ({"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16, "overrides": {V: "b8g16"}}, {}, "float32"),
    "pack-quantized": ({"type": "quantize", "method": "gptq", "bits": 4, "group_size": 16, "format": "compressed-tensors"},
                       {}, "float32"),
    "awq": ({"type": "quantize", "method": "awq", "bits": 4, "group_size": 16}, {}, "float32"),
    "int8-tied": ({"type": "quantize", "method": "int8"}, {"tie_word_embeddings": True}, "float32"),
    "w8a8-bf16": ({"type": "quantize", "method": "w8a8"}, {}, "bfloat16"),
    "sparse-bitmask": ({"type": "prune", "sparsity": 0.5, "format": "compressed-tensors"}, {}, "float32"),
    "sparse-24": ({"type": "prune", "pattern": "2:4", "format": "compressed-tensors"}, {}, "float32"),
    "dense": ({"type": "prune", "sparsity": 0.3}, {}, "bfloat16"),
}


def write_case(name: str, root: Path, text_file: Path) -> Path:
    stage, model_kw, dtype = CASES[name]
    kind = model_kw.get("kind", "llama")
    src = save_tiny(root / f"src-{name}", kind, num_hidden_layers=3,
                    **{k: v for k, v in model_kw.items() if k != "kind"})
    recipe = recipe_from_stage(str(src), stage, {"data": str(text_file), "samples": 6, "seq_len": 64}, "test",
                               output={"dtype": dtype})
    out = root / name
    run_recipe(recipe, out, RunOptions(device=CPU, stream=False), loaded=load_model(str(src)))
    return out


def windows(n: int = 3, T: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 384, (n, T), generator=torch.Generator().manual_seed(seed))


def lazy_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ckpt = LazyCheckpoint(path)
    parts = dict(streamed_logits(LazyLayers(ckpt, dtype), ids, device=CPU, dtype=dtype))
    assert all(p.is_meta for p in ckpt.model.parameters())  # everything went back to the meta device
    assert not ckpt._swapped
    return torch.cat([parts[k] for k in sorted(parts)])


@pytest.fixture(scope="module")
def written(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("formats")
    return {name: write_case(name, root, text_file) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_at_a_time_equals_the_loaded_model(written, name):
    out = written[name]
    dtype = getattr(torch, CASES[name][2])
    loaded = load_model(str(out), dtype=dtype)
    assert is_readable_dir(out)
    ids = windows()
    with torch.no_grad():
        expected = torch.cat([loaded.model(w.unsqueeze(0), use_cache=False).logits.float() for w in ids])
    got = lazy_logits(out, ids, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: batched vs one-window matmuls round differently
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    if name.startswith("gptq-mixed"):
        layer = LazyLayers(LazyCheckpoint(out), torch.float32)
        v = layer.load(0).self_attn.v_proj
        assert isinstance(v, DequantLinear) and v.bits == 8


def test_quantized_modules_are_swapped_in_and_back(written):
    ckpt = LazyCheckpoint(written["gptq"])
    skeleton = ckpt.layers[1].mlp.down_proj
    assert ckpt.format == "gptq" and len(ckpt.quantized) == 3 * 7
    layer = LazyLayers(ckpt, torch.float32).load(1)
    assert isinstance(layer.mlp.down_proj, DequantLinear) and layer.mlp.down_proj.q.dtype == torch.uint8
    assert not layer.input_layernorm.weight.is_meta
    ckpt.release("model.layers.1")
    assert ckpt.layers[1].mlp.down_proj is skeleton and skeleton.weight.is_meta
    # bytes of a layer count the packed tensors (4-bit codes + scales), not a float weight that is not there
    packed = sum(i.nbytes for k, i in ckpt.tensors.items() if k.startswith("model.layers.1."))
    assert ckpt.nbytes("model.layers.1") == packed


def test_damaged_quantized_module_is_one_line(written, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(written["gptq"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.qweight"
    tensors[key] = tensors[key][:, :-8].contiguous()  # fewer outputs than config.json implies
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    source = LazyLayers(LazyCheckpoint(bad), torch.float32)
    with pytest.raises(InputError, match="up_proj is stored as .* but the architecture has Linear"):
        source.load(0)
    # a quantized module that the architecture does not have: refused before any layer is read
    tensors = load_file(str(written["gptq"] / "model.safetensors"))
    tensors.update({k.replace("up_proj", "extra_proj"): v.clone() for k, v in tensors.items() if ".0.mlp.up_proj." in k})
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match="quantized module model.layers.0.mlp.extra_proj is not a linear"):
        LazyCheckpoint(bad)


def test_unknown_quantization_format_is_refused(written, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(written["dense"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (odd / "config.json").write_text(json.dumps(config))
    assert not is_readable_dir(odd)
    with pytest.raises(InputError, match="'bitsandbytes' is not one geminicompress reads"):
        LazyCheckpoint(odd)


def test_sharded_quantized_output_read_one_layer_at_a_time(tmp_path, text_file):
    """A streamed GPTQ output in ~20 KB shards: a module's packed tensors spread over several files."""
    from geminicompress.runtime.pipeline import run_recipe

    src = save_tiny(tmp_path / "src", num_hidden_layers=3)
    recipe = recipe_from_stage(str(src), CASES["gptq"][0], {"data": str(text_file), "samples": 6, "seq_len": 64},
                               "test")
    out = tmp_path / "out"
    run_recipe(recipe, out, RunOptions(stream=True, max_shard_bytes=20_000))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    up = {index[k] for k in index if k.startswith("model.layers.1.mlp.")}
    assert len(set(index.values())) > 5 and len(up) > 1  # one layer's quantized MLP in more than one file
    ids = windows()
    with torch.no_grad():
        model = load_model(str(out)).model
        expected = torch.cat([model(w.unsqueeze(0), use_cache=False).logits for w in ids])
    torch.testing.assert_close(lazy_logits(out, ids, torch.float32), expected, rtol=1e-5, atol=1e-5)
