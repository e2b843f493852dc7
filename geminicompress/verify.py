"""Verified on the way out: OUT, loaded back the way a user loads it, reproduces what the run computed.

Probe: 2 windows x 64 token ids drawn with a fixed seed from the tokenizer's vocabulary (no data file).
Before OUT is written they go through the in-process result: the model in memory after the stages, or,
for a streamed run, each layer as it is finished and then the head (streaming/verify.py). After OUT is
written into its hidden partial folder, it is loaded back in float32 (in memory by the project's loader
when it fits, else one layer at a time by `models/lazy.py`, the reader `eval --stream` uses) and the
same windows' logits are compared. Beyond the tolerance the run fails in one line before OUT is renamed
into place (output.py): a checkpoint that does not reproduce its model is never left behind.

What is compared with what. The in-process result is taken *as stored*: every float tensor rounded to
the dtype OUT holds (what `--dtype` asks for), except the weights a format stores as integer codes and
scales (gptq, awq, pack-quantized: `STORES_CODES`), which dequantize exactly to the in-process weights.
Both sides then hold identical values, run one window at a time on the same device, and can differ only
in the order of float32 operations (a fused q/k/v GEMM, the dequantization formula): the bound is 1e-4
of the largest |logit| (about 1,700 float32 unit roundoffs; every difference measured so far is 0).
A bound derived from the dtype on the unrounded model could not be that tight: storing the demo's W8A8
model in bfloat16 alone moves its logits by a third of their range (per-token activation quantization
turns the weights' rounding into code flips), more than many a packing bug would. That effect is
measured apart and recorded, not checked: `storage_rounding_diff` (the in-process logits before and
after rounding; null for a streamed run, which carries its layers as stored only). A broken writer or
loader (codes in the wrong order, a transposed or mis-scaled tensor, one module's codes corrupted) moves
the logits far beyond 1e-4. OUT is loaded in float32 so that the precision a user later computes in
stays out of the comparison.

`export.verified` in report.json: {"windows": [2, 64], "max_abs_logit_diff", "max_abs_logit",
"tolerance", "dtype", "storage_rounding_diff", "loaded": "in-memory" | "streamed", "seconds"}.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from geminicompress.errors import GeminiError
from geminicompress.progress import NullProgress, Progress

WINDOWS, TOKENS, SEED = 2, 64, 0
AUTO_FRACTION = 0.5  # load OUT in memory when its float32 weights take at most this share of available memory
TOLERANCE = 1e-4  # of the largest |logit|: both sides hold the same values (see above)


def probe_windows(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(WINDOWS, TOKENS) token ids drawn with a fixed seed from the ids both the tokenizer and the model know."""
    high = min(len(tokenizer), vocab_size) if tokenizer is not None else vocab_size
    return torch.randint(0, high, (WINDOWS, TOKENS), generator=torch.Generator().manual_seed(SEED))


@torch.no_grad()
def model_logits(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Logits (n, T, vocab) in float32 on the CPU of a model in memory, one window at a time."""
    device = next(model.parameters()).device
    return torch.cat([model(w.view(1, -1).to(device), use_cache=False).logits.float().cpu() for w in windows])


@torch.no_grad()
def as_stored(module: nn.Module, dtype: torch.dtype, keep: Iterable[str] = ()) -> None:
    """In place: every float parameter and persistent buffer of `module` rounded to `dtype` (what a
    checkpoint in `dtype` holds) and held in float32, except the tensors named in `keep` (held in float32
    as they are). Computed buffers (rotary frequencies) are left alone: a checkpoint does not hold them."""
    keep = set(keep)
    skip = {id(t) for n, t in module.named_parameters(remove_duplicate=False) if n in keep}
    for owner in module.modules():
        skip.update(id(b) for n, b in owner._buffers.items() if b is not None and n in owner._non_persistent_buffers_set)
    module._apply(lambda t: t if id(t) in skip or not t.is_floating_point()  # _apply: INT8 modules repack
                  else t.to(dtype).float() if dtype != torch.float32 else t.float())


def stored_dtype(out: Path) -> torch.dtype:
    """The float dtype of the checkpoint's weights (config.json's `dtype`)."""
    config = json.loads((out / "config.json").read_text())
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(config.get("dtype") or config.get("torch_dtype")), torch.float32)


def code_weights(out: Path) -> list[str]:
    """The weights the checkpoint at `out` stores as exact integer codes (names `<module>.weight`)."""
    from geminicompress import formats
    from geminicompress.models.lazy import read_headers

    config = json.loads((out / "config.json").read_text())
    key = formats.detect(config)
    if not formats.stores_codes(key):
        return []
    return [f"{name}.weight" for name in formats.module_reader(out, config).modules(read_headers(out))]


def compare(reference: torch.Tensor, got: torch.Tensor, stored: torch.dtype, loaded: str,
            unrounded: torch.Tensor | None = None, seconds: float = 0.0) -> dict[str, Any]:
    """The verification record; raises GeminiError when OUT's logits differ beyond the tolerance.
    reference: the in-process logits as stored (n, T, vocab); unrounded: before rounding, for the record
    (None for a streamed run, whose layers are carried as stored only)."""
    if got.shape != reference.shape:
        raise GeminiError(f"verification failed: the written checkpoint gives logits of shape {list(got.shape)}, "
                          f"the in-process model {list(reference.shape)}; the output was not kept")
    diff = float((got - reference).abs().max())
    scale = float(reference.abs().max())
    bound = TOLERANCE * scale
    rounding = _g(float((unrounded - reference).abs().max())) if unrounded is not None else None
    record = {"windows": list(reference.shape[:2]), "max_abs_logit_diff": _g(diff), "max_abs_logit": _g(scale),
              "tolerance": _g(bound), "dtype": str(stored).removeprefix("torch."),
              "storage_rounding_diff": rounding, "loaded": loaded, "seconds": round(seconds, 3)}
    if not diff <= bound:  # also catches NaN
        raise GeminiError(f"verification failed: the written checkpoint's logits differ from the in-process "
                          f"model's by up to {diff:.4g} (allowed {bound:.3g}: {TOLERANCE:g} of the largest logit, "
                          f"{scale:.4g}); the output was not kept. This is a bug in a format writer or loader: "
                          "please report it (--no-verify skips the check)")
    return record


def _g(x: float) -> float:
    return float(f"{x:.6g}")


class Probe:
    """The probe windows and the in-process model's logits on them, taken before export (exporters may
    cast the model); `check(out, model)` compares OUT's with the model's as stored."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        self.windows = probe_windows(tokenizer, model.config.vocab_size)
        self.reference = model_logits(model, self.windows)  # (n, T, vocab)
        self.computed = {n: b.detach().clone() for n, b in _computed_buffers(model)}  # an exporter may cast them

    def check(self, out: Path, model: nn.Module, *, trust_remote_code: bool = False,
              progress: Progress | None = None, streamed: bool | None = None) -> dict[str, Any]:
        """Load OUT back and compare its logits with the model's as stored; raise GeminiError beyond the
        tolerance. Leaves `model` holding float32 tensors with the values OUT holds."""
        progress = progress or NullProgress()
        t0 = time.perf_counter()
        streamed = too_big(out) if streamed is None else streamed
        progress.info(f"verifying {final_name(out)}: loading it back {'one layer at a time' if streamed else 'in memory'}")
        got = loaded_logits(out, self.windows, trust_remote_code, streamed, next(model.parameters()).device)
        stored = stored_dtype(out)
        as_stored(model, stored, code_weights(out))
        for name, value in self.computed.items():
            _set_buffer(model, name, value)
        reference = model_logits(model, self.windows) if stored != torch.float32 else self.reference
        return compare(reference, got, stored, "streamed" if streamed else "in-memory", self.reference,
                       time.perf_counter() - t0)


def final_name(out: Path) -> str:
    return out.name.removeprefix(".").removesuffix(".partial")


def too_big(out: Path) -> bool:
    """Whether OUT, loaded in float32, would take more than AUTO_FRACTION of the available memory."""
    from geminicompress.eval.streamed import loaded_bytes
    from geminicompress.models.lazy import available_memory, is_readable_dir

    return is_readable_dir(out) and loaded_bytes(out, torch.float32) > AUTO_FRACTION * available_memory()


def loaded_logits(out: Path, windows: torch.Tensor, trust_remote_code: bool, streamed: bool,
                  device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """OUT's logits (n, T, vocab) in float32, loaded in float32 by the loader (or read one layer at a time),
    computed on `device` one window at a time like the in-process side: with per-token INT8 activations a
    last-bit difference (a batched matmul) can flip an activation code, which is not what is checked here."""
    if streamed:
        from geminicompress.models.forward import final_hidden, head_logits
        from geminicompress.models.lazy import LazyCheckpoint, LazyLayers

        source = LazyLayers(LazyCheckpoint(out, trust_remote_code=trust_remote_code), torch.float32)
        hidden = final_hidden(source, windows, device=device, batch=1)
        try:
            return torch.cat([logits for _, logits in head_logits(source, hidden, device=device)])
        finally:
            hidden.close()
    from geminicompress.models.loading import load_model

    model = load_model(str(out), dtype=torch.float32, trust_remote_code=trust_remote_code).model.to(device)
    try:
        return model_logits(model, windows)
    finally:
        del model
        gc.collect()


def _computed_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}.{n}" if prefix else n, b) for prefix, owner in model.named_modules()
            for n, b in owner._buffers.items() if b is not None and n in owner._non_persistent_buffers_set]


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    owner._buffers[leaf] = value.to(owner._buffers[leaf].device)
