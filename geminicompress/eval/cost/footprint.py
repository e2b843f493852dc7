"""What a model costs besides time: peak memory, size on disk, parameter count, weight sparsity.

- Peak memory: on a GPU, `torch.cuda.max_memory_allocated` after a reset. On a CPU, growth of the
  process's resident set over its value at the start: the kernel's high-water mark (VmHWM, reset
  through /proc/self/clear_refs) where Linux allows it, else a 5 ms psutil sampler.
- Size on disk: the weight files of the model (safetensors, pickles, gguf), not tokenizer or config, and
  not the prune stage's keep-masks (`prune_masks.safetensors`), which are reported apart (`masks_mb`).
- Tensors in memory: exact bytes of parameters and buffers (deterministic, unlike the peak).
- Parameters: every parameter, plus the logical weights of packed quantized linears (modules with
  `in_features`/`out_features` whose weight is not a parameter of that shape).
- Sparsity: fraction of pruned weights in the linear layers, lm_head excluded (it is never pruned and
  would only dilute the figure): exact zeros of float weights; for quantized linears the weights that
  the prune masks saved beside them pruned and that are still zero, or unknown (None) without masks.
- Quantization zeros: fraction of the quantized linears' weights that round to exactly zero (the code
  equal to the zero point). A 4-bit grid puts ~1/8 of ordinary weights there: that is not sparsity.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import psutil
import torch
from torch import nn

from geminicompress.formats.masks import MASKS_FILE

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MB = 1024**2
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return _vm_hwm_bytes() is not None
    except OSError:
        return False


class PeakMemory:
    """`with PeakMemory(device) as pm: ...` then `pm.peak_mb` (growth in MB during the block)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._proc = psutil.Process()
        self._start = self._proc.memory_info().rss
        self._hwm = _reset_hwm()
        if not self._hwm:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._hwm:
            peak = _vm_hwm_bytes() or 0
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled, self._proc.memory_info().rss)
        self.peak_mb = round(max(peak - self._start, 0) / MB, 1)


def weights_size_mb(path: Path | None) -> float | None:
    """Size of the weight files of a model directory (or of one .gguf file), in MB; side files excluded."""
    if path is None or not path.exists():
        return None
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
                                           and p.name != MASKS_FILE]
    return round(sum(p.stat().st_size for p in files) / MB, 2)


def masks_size_mb(path: Path | None) -> float | None:
    """Size of the prune masks saved next to the weights, in MB; None when there are none."""
    masks = prune_masks_path(path)
    return round(masks.stat().st_size / MB, 2) if masks else None


def prune_masks_path(path: Path | None) -> Path | None:
    """The prune stage's masks file next to the weights, or None."""
    if path is None or not path.is_dir() or not (path / MASKS_FILE).is_file():
        return None
    return path / MASKS_FILE


def _dense_weight(module: nn.Module) -> torch.Tensor | None:
    """The (out, in) weight of a linear-like module when stored unpacked (float or int8 codes)."""
    w = getattr(module, "weight", None)
    out_f, in_f = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if isinstance(w, torch.Tensor) and out_f is not None and tuple(w.shape) == (out_f, in_f):
        return w
    return None


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "in_features") and hasattr(m, "out_features") and not n.endswith("lm_head")]


def count_params(model: nn.Module) -> int:
    """Parameters (a tied tensor once); a packed quantized linear counts as in*out (+ bias) instead of
    whatever packed tensors it holds."""
    packed = {id(m) for _, m in _linears(model) if not isinstance(_dense_weight(m), nn.Parameter)}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if id(module) in packed:
            bias = getattr(module, "bias", None)
            total += int(module.in_features) * int(module.out_features)
            total += bias.numel() if isinstance(bias, torch.Tensor) else 0
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def tensor_mb(model: nn.Module) -> float:
    """Exact bytes held by parameters and buffers (tied tensors once), in MB: the deterministic part
    of the memory figure, next to the measured (noisier) peak."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return round(sum(seen.values()) / MB, 2)


def _is_float_weight(w: torch.Tensor) -> bool:
    return isinstance(w, nn.Parameter) and w.is_floating_point()


def weight_sparsity(model: nn.Module, masks: Path | None = None) -> float | None:
    """Fraction of pruned weights over the linear layers (lm_head excluded): zeros of float weights;
    for quantized linears, the weights the keep-masks in the file `masks` pruned that are still zero (read one at a time, so that
    the peak memory measured around this stays the model's). None if a quantized linear has no mask
    (rounding to zero and pruning cannot be told apart) or there are no linears."""
    from safetensors import safe_open

    zeros = count = 0
    with contextlib.ExitStack() as stack:
        stored = stack.enter_context(safe_open(str(masks), "pt")) if masks is not None else None
        names = set(stored.keys()) if stored is not None else set()
        for name, m in _linears(model):
            w = _dense_weight(m)
            if w is None:
                continue
            if _is_float_weight(w):
                zeros += int((w == 0).sum())
            elif f"{name}.weight" in names:
                pruned = stored.get_tensor(f"{name}.weight") == 0  # a later stage may have moved some off zero
                zeros += int((pruned & (w == 0)).sum())
            else:
                return None
            count += w.numel()
    return round(zeros / count, 6) if count else None


def quantization_zeros(model: nn.Module) -> float | None:
    """Fraction of the quantized linears' weights whose quantized value is exactly zero; None if no
    linear is quantized. (Int8 codes are symmetric, so code 0 is value 0; packed linears' `weight` is
    their dequantized weight.)"""
    zeros = count = 0
    for _, m in _linears(model):
        w = _dense_weight(m)
        if w is None or _is_float_weight(w):
            continue
        zeros += int((w == 0).sum())
        count += w.numel()
    return round(zeros / count, 6) if count else None
