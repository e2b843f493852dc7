"""Write an INT8 model in compressed-tensors' `int-quantized` layout (what vLLM and llm-compressor read).

On disk, for every quantized linear `<name>`:
    <name>.weight        int8  (out, in)   codes in [-127, 127]
    <name>.weight_scale  float (out, 1)    one symmetric scale per output channel
(no zero points: symmetric). Everything else is stored as in a dense checkpoint. `config.json` gains

    "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": [...float linears...],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {8-bit int, symmetric, channel},
                          "input_activations": {8-bit int, symmetric, token, dynamic} | null}}}

`input_activations` is null for weight-only `int8` (W8A16) and dynamic per-token for `w8a8`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from geminicompress.compress.int8.modules import _Int8Base

FORMAT = "int-quantized"


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def quantization_config(method: str, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for `method` in ("int8", "w8a8")."""
    group = {
        "targets": ["Linear"],
        "weights": _args("channel", dynamic=False),
        "input_activations": _args("token", dynamic=True) if method == "w8a8" else None,
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def float_linears(model: nn.Module) -> list[str]:
    """Names of the nn.Linear modules left in float (the checkpoint's `ignore` list)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def int_quantized_exporter(method: str, dtype: str) -> Callable[[Any, Any, Path], dict]:
    """An exporter `(model, tokenizer, out) -> info` for `ctx.exporter`; float tensors saved as `dtype`."""

    def export(model: nn.Module, tokenizer: Any, out: Path) -> dict:
        model = model.to(getattr(torch, dtype))  # float tensors only: int8 codes are untouched
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config(method, float_linears(model))
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return {"format": f"compressed-tensors:{FORMAT}", "method": method, "dtype": dtype,
                "quantized_linears": sum(isinstance(m, _Int8Base) for m in model.modules())}

    return export
