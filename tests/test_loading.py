"""Model resolution and safe loading."""

import shutil

import pytest
import torch

from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats import detect as format_key
from geminicompress.models import load_model, resolve_model


def test_resolve_kinds(tiny_dir, tmp_path):
    assert resolve_model(str(tiny_dir)).kind == "dir"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M").kind == "hub"
    with pytest.raises(InputError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(InputError, match="does not exist"):
        resolve_model(str(tmp_path / "x.gguf"))


def test_load_dir_roundtrip(tiny_dir):
    loaded = load_model(str(tiny_dir))
    assert loaded.format is None
    ids = loaded.tokenizer("def f(x): return x", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.shape == (1, ids.shape[1], 384)


def test_pickled_weights_refused_unless_allowed(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = tmp_path / "pickled"
    shutil.copytree(tiny_dir, target)
    (target / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    torch.save(model.state_dict(), target / "pytorch_model.bin")
    with pytest.raises(InputError, match="pickled weights.*--allow-pickle"):
        load_model(str(target))
    loaded = load_model(str(target), allow_pickle=True)
    ref = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(loaded.model.model.layers[0].mlp.up_proj.weight, ref)


def test_hub_id_offline_is_one_clear_error():
    with pytest.raises(GeminiError, match="could not load 'nobody/not-a-model' from the hub"):
        load_model("nobody/not-a-model")


def test_format_key():
    assert format_key({}) is None
    assert format_key({"quantization_config": {"quant_method": "gptq"}}) == "gptq"
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    assert format_key({"quantization_config": ct}) == "compressed-tensors:pack-quantized"
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "int-quantized"}}}
    assert format_key({"quantization_config": ct}) == "compressed-tensors:int-quantized"


def test_every_format_module_detects_its_own_key():
    """The registry's keys and each module's own `detect` agree (one module may serve two keys)."""
    import importlib

    from geminicompress.formats import FORMATS, detect

    examples = {
        "gptq": {"quant_method": "gptq", "bits": 4},
        "awq": {"quant_method": "awq", "bits": 4},
        "compressed-tensors:pack-quantized": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        "compressed-tensors:int-quantized": {"quant_method": "compressed-tensors",
                                             "config_groups": {"g": {"format": "int-quantized"}}},
        "compressed-tensors:sparse-bitmask": {"quant_method": "compressed-tensors",
                                              "sparsity_config": {"format": "sparse-bitmask"}},
        "compressed-tensors:sparse-24-bitmask": {"quant_method": "compressed-tensors", "format": "sparse-24-bitmask"},
    }
    assert set(examples) == set(FORMATS)
    for key, qc in examples.items():
        assert detect({"quantization_config": qc}) == key
        owners = [k for k in FORMATS if importlib.import_module(FORMATS[k]).detect(qc)]
        assert {FORMATS[k] for k in owners} == {FORMATS[key]}, key


def _cli_with_unreachable_hub(tmp_path, *args: str):
    """Run the CLI in a subprocess with the hub endpoint pointed at a closed local port (no network)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "geminicompress", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


def test_unreachable_hub_fails_at_once_in_one_line(tmp_path):
    # Before: five retries per file, each logged twice (12 lines, ~26 s), then the error.
    res = _cli_with_unreachable_hub(tmp_path, "quantize", "nobody/not-a-model", "--method", "int8", "-o", "out")
    assert res.returncode == 1
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert "Retrying" not in res.stdout + res.stderr
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and "127.0.0.1:9 is unreachable" in errors[0] and "not in the local cache" in errors[0]
    assert [ln for ln in lines if not ln.startswith("error:")] == ["loading nobody/not-a-model"]
    assert not (tmp_path / "out").exists()


def test_cached_hub_id_loads_with_the_hub_unreachable(tmp_path):
    from tiny import save_tiny

    revision = "0" * 40  # the hub cache layout: refs/main names a snapshot folder
    repo = tmp_path / "hf" / "hub" / "models--local--tiny"
    save_tiny(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    res = _cli_with_unreachable_hub(tmp_path, "quantize", "local/tiny", "--method", "int8", "-o", "out")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "out" / "report.json").is_file()
