"""llama-quantize's mixes as data (formats/gguf_mix.py): the rules as read from llama-quant.cpp, and (slow, where
llama-cpp-python is installed) the types llama.cpp's own `llama_model_quantize` gives every tensor of tiny models
built to reach the rules: 16 layers (use_more_bits, the first eighth / sixteenth), KV heads for a GQA of 4 and 2,
rows of 256 (K types) and of 320 (fallbacks), tied and untied embeddings, with and without an importance matrix."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tiny import save_tiny

from geminicompress.formats import gguf_mix
from geminicompress.formats.gguf_export import GGUFOptions, export, mix_types

MIXES = list(gguf_mix.MIXES)


def test_the_rules_as_read_from_llama_cpp():
    m = gguf_mix.Model(n_layer=30, gqa=3, imatrix=True)
    more = [i for i in range(30) if gguf_mix.CONDITIONS["more_bits"](i, 30, m)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    t = gguf_mix.tensor_type
    assert t("blk.0.ffn_down.weight", 1536, 0, "Q4_K_M", m, False) == "Q6_K"
    assert t("blk.3.ffn_down.weight", 1536, 3, "Q4_K_M", m, False) == "Q4_K"
    assert t("blk.3.ffn_down.weight", 576, 3, "Q4_K_M", m, False) == "Q5_0"  # 576: not a multiple of 256
    assert t("blk.0.attn_v.weight", 576, 0, "Q4_K_M", m, False) == "Q8_0"  # Q6_K falls back
    assert t("blk.0.attn_v.weight", 576, 0, "Q2_K", m, False) == "Q4_0"  # Q3_K (GQA 3) falls back
    assert t("blk.0.attn_v.weight", 1024, 0, "Q2_K", gguf_mix.Model(30, 4, True), False) == "Q4_K"
    assert t("blk.2.ffn_down.weight", 1536, 2, "Q4_0", m, False) == "Q4_1"  # imatrix, first eighth
    assert t("blk.2.ffn_down.weight", 1536, 2, "Q4_0", gguf_mix.Model(30, 3, False), False) == "Q4_0"
    assert t("blk.0.ffn_down.weight", 2048, 0, "Q3_K_M", m, False) == "Q5_K"
    assert t("token_embd.weight", 576, None, "Q4_K_M", m, True) == "Q8_0"
    assert t("token_embd.weight", 1024, None, "Q4_K_M", m, True) == "Q6_K"
    assert t("token_embd.weight", 1024, None, "Q4_K_M", m, False) == "Q4_K"  # untied: the default
    assert t("blk.0.ffn_up.weight", 100, 0, "Q4_K_M", m, False) == "F16"  # no block fits


def _llama_python() -> str | None:
    from geminicompress.eval.engines.llama_eval import find_python

    try:
        return find_python(os.environ.get("GEMINICOMPRESS_LLAMA_PYTHON") or "/root/venv-llama/bin/python")
    except Exception:  # noqa: BLE001  (no llama-cpp-python here)
        return None


def _shapes(model_dir: Path) -> tuple[dict, dict]:
    from geminicompress.models.loading import load_model

    model = load_model(str(model_dir)).model
    shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layers." in n}
    return model.config.to_dict(), shapes


@pytest.mark.slow
@pytest.mark.parametrize("kv,tied", [(1, False), (2, True)])
def test_every_mix_gives_each_tensor_llama_cpp_s_type(tmp_path, kv, tied):
    python = _llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not installed (set GEMINICOMPRESS_LLAMA_PYTHON)")
    import gguf
    from gguf import GGUFReader

    from geminicompress.eval.engines.llama_eval import run_driver
    from geminicompress.formats.gguf_export import gguf_arch

    model_dir = save_tiny(tmp_path / "m", hidden_size=256, intermediate_size=320, num_hidden_layers=16,
                          num_attention_heads=4, num_key_value_heads=kv, tie_word_embeddings=tied)
    f32 = tmp_path / "f32.gguf"
    export(model_dir, GGUFOptions(embeddings="f32", floats="f32"), dest=f32)
    config, shapes = _shapes(model_dir)
    table = gguf.get_tensor_name_map(gguf_arch(config).arch, 16)
    names = {r.name: r for r in GGUFReader(str(f32)).tensors}
    imatrix = {n: [1.0] * int(r.shape[0]) for n, r in names.items() if n.startswith("blk.") and len(r.shape) == 2}
    for imat in (False, True):
        tasks = [{"kind": "quantize", "src": str(f32), "dst": str(tmp_path / f"{mix}-{imat}.gguf"), "ftype": mix,
                  "imatrix": imatrix if imat else None} for mix in MIXES]
        result = run_driver(python, {"model": None, "tasks": tasks})
        assert not result.get("error"), result
        for mix in MIXES:
            theirs = {r.name: r.tensor_type.name for r in GGUFReader(str(tmp_path / f"{mix}-{imat}.gguf")).tensors}
            ours = mix_types(config, shapes, mix, imat)
            assert len(ours) == 16 * 7
            for module, qtype in ours.items():
                name = table.get_name(f"{module}.weight", try_suffixes=(".weight",))
                assert theirs[name] == qtype, (mix, imat, name, theirs[name], qtype)
            emb = gguf_mix.tensor_type("token_embd.weight", 256, None, mix, gguf_mix.Model(16, 4 // kv, imat), tied)
            assert theirs["token_embd.weight"] == emb, (mix, imat, theirs["token_embd.weight"], emb)
            if not tied:
                out = gguf_mix.tensor_type("output.weight", 256, None, mix, gguf_mix.Model(16, 4 // kv, imat), False)
                assert theirs["output.weight"] == out, (mix, imat)
