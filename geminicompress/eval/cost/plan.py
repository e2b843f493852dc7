"""Before loading any model: latency defaults for the device, a check that DATA holds a window, and a
rough estimate of how long the evaluation will take.

Defaults are proportionate to the device. A CPU decodes a 135M-parameter model at ~15 tokens/s, so the
GPU-sized protocol (prompt 512, 128 new tokens, batches 1/4/8, 5 repeats) takes many minutes per model
there; on a CPU the defaults are prompt 128, 32 new tokens, batches 1/4, 3 repeats.

The estimate is a cost model, not a measurement: perplexity and prefill cost 2 x params FLOPs per token
at an assumed rate per thread (CPU) or per GPU; a decode step reads every weight once at an assumed
memory bandwidth. The rates were fitted to the demo model (135M, fp32) on a 2-core AVX-512 CPU: prefill
2.8 ms/token, decode 66 ms/step with 2 threads. It is meant to tell minutes from hours, no better.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from geminicompress.core.errors import GeminiError, InputError
from geminicompress.eval.config import EvalStage

DEVICE_DEFAULTS = {
    "cpu": {"prompt_len": 128, "gen_len": 32, "batch_sizes": [1, 4], "repeats": 3},
    "cuda": {"prompt_len": 512, "gen_len": 128, "batch_sizes": [1, 4, 8], "repeats": 5},
}
# (FLOP/s for prefill, bytes/s for decode): per CPU thread, or per GPU
_RATES = {"cpu": (45e9, 4e9), "cuda": (50e12, 1.5e12)}
DEFAULT_SEQ_LEN = 2048  # the perplexity window without --seq-len (or the model's context, when shorter)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_GPU_STEP_FLOOR_S = 4e-4  # per decoder layer: kernel launches bound small models' decode steps on a GPU


def with_device_defaults(options: EvalStage, device: torch.device) -> EvalStage:
    """Fill the latency options the user left unset with the device's defaults."""
    defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    return options.model_copy(update={k: v for k, v in defaults.items() if getattr(options, k) is None})


def _local_folder(spec: str) -> Path | None:
    """The folder of a local model (directory, or the converted demo); None for anything else."""
    from geminicompress.models import demo
    from geminicompress.models.loading import resolve_model

    try:
        source = resolve_model(spec)
    except GeminiError:
        return None
    folder = demo.demo_cache_dir() if source.kind == "demo" else source.path if source.kind == "dir" else None
    return None if folder is None else Path(folder)


def peek_config(spec: str) -> dict | None:
    """config.json of a local model (directory, or the converted demo) without loading weights."""
    folder = _local_folder(spec)
    try:
        return json.loads((folder / "config.json").read_text()) if folder else None
    except (OSError, json.JSONDecodeError):
        return None


def peek_tokenizer(spec: str, trust_remote_code: bool):
    """The tokenizer of a local model (directory or converted demo), or None when it is not at hand."""
    from transformers import AutoTokenizer

    folder = _local_folder(spec)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None


def config_context(config: dict) -> int | None:
    """The model's context length: the first of CONTEXT_KEYS its config sets to a positive int, else None."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_params(config: dict) -> int | None:
    """Parameter count of a Llama-shaped decoder from its config (None when the keys are not there)."""
    try:
        h, layers, inter, vocab = (int(config[k]) for k in
                                   ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim  # q, o + k, v
    mlp = 3 * h * inter  # gate, up, down
    embed = vocab * h * (1 if config.get("tie_word_embeddings", True) else 2)
    norms = 2 * h  # input and post-attention RMSNorm weights
    return layers * (attn + mlp + norms) + h + embed  # + the final norm


def check_windows(n_tokens: int, seq_len: int, data: str) -> None:
    """Perplexity needs one full window: say so before any model is loaded."""
    if n_tokens < seq_len:
        raise InputError(f"--data {data} has {n_tokens} tokens, fewer than one perplexity window of {seq_len}: "
                         "give longer text, a smaller --seq-len, or --no-quality to time latency only")


def estimate_seconds(params: int, n_models: int, tokens: int, options: EvalStage, device: torch.device,
                     threads: int, bytes_per_param: int = 4, layers: int = 30) -> float:
    """Rough duration of `evaluate` (see the module docstring for the cost model)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    flops, bandwidth = _RATES[kind]
    if kind == "cpu":
        flops, bandwidth = flops * threads, bandwidth * threads
    per_token = 2.0 * params / flops
    step = params * bytes_per_param / bandwidth
    if kind == "cuda":
        step = max(step, layers * _GPU_STEP_FLOOR_S)
    seconds = tokens * per_token if options.quality else 0.0
    if options.latency:
        runs = options.warmup + options.repeats
        for b in sorted(set(options.batch_sizes) | {1}):
            seconds += runs * (b * options.prompt_len * per_token + (options.gen_len - 1) * step * (1 + 0.1 * b))
    return seconds * n_models


def describe_duration(seconds: float) -> str:
    if seconds < 90:
        return f"~{max(5, round(seconds / 5) * 5):.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"
