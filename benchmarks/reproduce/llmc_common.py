"""Shared scaffolding of the *_llmc_ref.py scripts, which run in the llm-compressor venv (its own
transformers): load the model and the exact calibration ids, run `oneshot`, time it.

Imported from the script's folder (python puts it first on sys.path), never from the package.
"""

from __future__ import annotations

import time

import torch


def load(model_dir: str, ids_file: str, threads: int, layers: int = 0, dtype: str = "float32"):
    """(model in `dtype`, tokenizer, calibration Dataset, ids) with llm-compressor 0.14's CPU fix applied."""
    torch.set_num_threads(threads)
    from datasets import Dataset
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # llm-compressor 0.14 pins cached activations, which fails on a machine without an accelerator.
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, index: None
    ids = torch.load(ids_file)  # (n, T)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    if layers:  # timing runs on the first layers only
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    return model, tok, data, ids


def timed_oneshot(model, data, ids: torch.Tensor, recipe) -> float:
    """Run llm-compressor's oneshot on exactly these windows, in order; return its wall seconds."""
    from llmcompressor import oneshot

    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    return time.perf_counter() - t0
