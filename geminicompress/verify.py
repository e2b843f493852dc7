"""Verified on the way out: OUT, loaded back the way a user loads it, reproduces what the run computed.

Before OUT is written, a few probe windows (2 x 64 token ids drawn with a fixed seed from the
tokenizer's vocabulary: no data file) go through the in-process result: the model in memory after the
stages, or, for a streamed run, each layer as it is finished (streaming's verifying sink) and then the
head. After OUT is written into its hidden partial folder, it is loaded back (in memory by the
project's loader when it fits, else one layer at a time by `models/lazy.py`, the reader `eval` uses)
and the same windows' logits are compared. A difference beyond the tolerance fails the run in one line
before OUT is renamed into place (output.py), so a checkpoint that does not reproduce its model is
never left behind. `export.verified` in report.json records what was compared.

Tolerance, relative to the largest |logit| of the in-process result (logits are compared as computed
in float32; OUT is loaded in float32 so that only what the file holds can differ, not the precision a
user later computes in):
- float32 OUT: the same weights (GPTQ/AWQ scales are rounded to the stored float16 before quantizing,
  so the dequantized weights are the in-process ones); only the order of float operations differs
  (a batched or fused matmul, the dequantization formula), a few float32 roundings per product,
  amplified by depth: 1e-4 (about 2^-13, some 800 float32 unit roundoffs).
- bfloat16 / float16 OUT: every float weight the file holds is the in-process one rounded to 8 / 11
  significant bits, i.e. a relative error of up to u = 2^-8 / 2^-11 per weight. On the demo model
  (30 layers) that moves the largest logit difference to about 1.5 u of the logit scale (measured for
  every method; docs/streaming.md); the bound is 8 u (3.1% / 0.39%). A broken writer (codes in the
  wrong order, a transposed or mis-scaled tensor) changes the logits by the order of the logits
  themselves, far above either bound.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from geminicompress.errors import GeminiError
from geminicompress.progress import NullProgress, Progress

WINDOWS, TOKENS, SEED = 2, 64, 0
AUTO_FRACTION = 0.5  # load OUT in memory when its float32 weights take at most this share of available memory
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FLOAT32_TOLERANCE = 1e-4
ROUNDING_FACTOR = 8  # tolerance = 8 u for a half-precision OUT


def probe_windows(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(WINDOWS, TOKENS) token ids drawn with a fixed seed from the ids both the tokenizer and the model know."""
    high = min(len(tokenizer), vocab_size) if tokenizer is not None else vocab_size
    return torch.randint(0, high, (WINDOWS, TOKENS), generator=torch.Generator().manual_seed(SEED))


def tolerance(dtype: torch.dtype) -> float:
    """Largest |logit difference| allowed, relative to the largest |logit|, for an OUT stored in `dtype`."""
    return FLOAT32_TOLERANCE if dtype == torch.float32 else ROUNDING_FACTOR * UNIT_ROUNDOFF[dtype]


@torch.no_grad()
def model_logits(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Logits (n, T, vocab) in float32 on the CPU of a model in memory, one window at a time."""
    device = next(model.parameters()).device
    return torch.cat([model(w.view(1, -1).to(device), use_cache=False).logits.float().cpu() for w in windows])


class Probe:
    """The probe windows and the in-process logits they gave; `check(out)` compares OUT's."""

    def __init__(self, windows: torch.Tensor, reference: torch.Tensor) -> None:
        self.windows, self.reference = windows, reference  # (n, T), (n, T, vocab)

    @classmethod
    def of_model(cls, model: nn.Module, tokenizer: Any) -> "Probe":
        windows = probe_windows(tokenizer, model.config.vocab_size)
        return cls(windows, model_logits(model, windows))

    def check(self, out: Path, *, trust_remote_code: bool = False, progress: Progress | None = None,
              streamed: bool | None = None) -> dict[str, Any]:
        """Load OUT back, compare its logits with the in-process ones; raise GeminiError beyond the tolerance."""
        progress = progress or NullProgress()
        t0 = time.perf_counter()
        stored = _stored_dtype(out)
        if streamed is None:
            streamed = _too_big(out)
        progress.info(f"verifying {out.name.removeprefix('.').removesuffix('.partial')}: loading it back "
                      f"{'one layer at a time' if streamed else 'in memory'}")
        got = _streamed_logits(out, self.windows, trust_remote_code) if streamed else \
            _loaded_logits(out, self.windows, trust_remote_code)
        return compare(self.reference, got, stored, "streamed" if streamed else "in-memory", time.perf_counter() - t0)


def compare(reference: torch.Tensor, got: torch.Tensor, stored: torch.Tensor | torch.dtype, loaded: str,
            seconds: float = 0.0) -> dict[str, Any]:
    """The verification record; raises GeminiError when OUT's logits differ beyond the tolerance."""
    if got.shape != reference.shape:
        raise GeminiError(f"verification failed: the written checkpoint gives logits of shape {list(got.shape)}, "
                          f"the in-process model {list(reference.shape)}")
    diff = float((got - reference).abs().max())
    scale = float(reference.abs().max())
    bound = tolerance(stored) * scale
    record = {"windows": list(reference.shape[:2]), "max_abs_logit_diff": round(diff, 6),
              "max_abs_logit": round(scale, 4), "tolerance": round(bound, 6), "dtype": _name(stored),
              "loaded": loaded, "seconds": round(seconds, 3)}
    if not diff <= bound:  # also catches NaN
        raise GeminiError(f"verification failed: the written checkpoint's logits differ from the in-process "
                          f"model's by up to {diff:.4g} (allowed {bound:.4g} for {_name(stored)} weights: "
                          f"{tolerance(stored):.2g} of the largest logit, {scale:.4g}); the output was not kept. "
                          "This is a bug in the format writer or loader: please report it (--no-verify skips the check)")
    return record


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored_dtype(out: Path) -> torch.dtype:
    config = json.loads((out / "config.json").read_text())
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(config.get("dtype") or config.get("torch_dtype")), torch.float32)


def _too_big(out: Path) -> bool:
    from geminicompress.eval.streamed import loaded_bytes
    from geminicompress.models.lazy import available_memory, is_readable_dir

    return is_readable_dir(out) and loaded_bytes(out, torch.float32) > AUTO_FRACTION * available_memory()


def _loaded_logits(out: Path, windows: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    from geminicompress.models.loading import load_model

    model = load_model(str(out), dtype=torch.float32, trust_remote_code=trust_remote_code).model
    try:
        return model_logits(model, windows)
    finally:
        del model
        gc.collect()


def _streamed_logits(out: Path, windows: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    from geminicompress.models.forward import streamed_logits
    from geminicompress.models.lazy import LazyCheckpoint, LazyLayers

    ckpt = LazyCheckpoint(out, trust_remote_code=trust_remote_code)
    parts = dict(streamed_logits(LazyLayers(ckpt, torch.float32), windows, device=torch.device("cpu")))
    return torch.cat([parts[k] for k in sorted(parts)])
