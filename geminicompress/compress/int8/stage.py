"""The `quantize` stage for methods `int8` (W8A16) and `w8a8`: optional SmoothQuant, then per-channel
INT8 of every linear not ignored, each swapped for the fast module of `modules.py`, one decoder layer at a
time; the linears outside the layers (an output head not ignored) after them.

Steps per layer: (w8a8, SmoothQuant on by default with alpha 0.5) the layer's per-channel activation maxima
from its inputs on the calibration windows (the stage's DATA or the recipe's; builtin:pydoc unless told
otherwise), one window at a time, averaged over the windows (smoothquant.py says why); the float layer's
outputs from that same pass are the next layer's inputs, so every statistic is the float model's, as
SmoothQuant takes it; the scales are folded into the producing norm/linear -> every targeted linear made
INT8. Per-token INT8 activations without SmoothQuant drift ~2x more on the demo model (docs/int8.md).
Written as compressed-tensors `int-quantized` (w8a8) or `pack-quantized` 8-bit (int8: what vLLM reads as
W8A16); the summary lists what was done to every linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.int8 import smoothquant as sq
from geminicompress.compress.int8.config import Int8Stage
from geminicompress.compress.targets import check_patterns_match, compile_patterns
from geminicompress.core.arch import arch_for, get_module, set_module
from geminicompress.core.config import ignore_to_check
from geminicompress.core.grid import QuantSpec
from geminicompress.engine.contract import Done, LayerStage, StageContext
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.core.errors import InputError
from geminicompress.formats import check_shapes
from geminicompress.formats.int_quantized import Int8Writer
from geminicompress.kernels.int8 import MODULES
from geminicompress.kernels.int8_quant import relative_error


class Int8(LayerStage):
    """int8 / w8a8 as the engine runs it."""

    resume_from_input = True  # the next layer's inputs are the float layer's outputs (engine/export.py load_back_of)
    quantizes = True

    def __init__(self, cfg: Int8Stage, ctx: StageContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        # the tied head from the layer source: a skeleton read from disk is not tied in memory
        self.targets, self.kept = select_linears(ctx.model, cfg.ignore, ignore_to_check(cfg),
                                                 ctx.layers.tied_output)
        if not self.targets:
            raise InputError("the ignore patterns leave no linear layer to quantize")
        if cfg.format == "gguf":  # Q8_0 blocks of 32 input columns
            check_shapes("gguf", {n: tuple(get_module(ctx.model, n).weight.shape) for n in self.targets}, QuantSpec(8))
        self.calibrated = cfg.smoothquant_alpha is not None
        self.groups, self.skipped = (sq.foldable_groups(ctx.model, arch_for(ctx.model), set(self.targets))
            if self.calibrated else ([], []))

    def quantize(self, root: nn.Module, prefix: str, smoothed: dict[str, float] | None = None
                 ) -> list[tuple[nn.Module, dict[str, Any]]]:
        """Swap every targeted linear under module `root` (named `prefix` in the model) for its INT8 module;
        returns (the module, its row of the summary) for each."""
        made = []
        head = f"{prefix}." if prefix else ""
        for full in self.targets:
            if not (full == prefix or full.startswith(head)):
                continue
            rel = full[len(head):]
            linear = get_module(root, rel) if rel else root
            # GGUF's Q8_0 stores fp16 scales: the codes are rounded on those
            module = MODULES[self.cfg.method].from_linear(linear, torch.float16 if self.cfg.format == "gguf"
                                                          else torch.float32)
            err = relative_error(linear.weight, module.weight, module.weight_scale)
            if rel:
                set_module(root, rel, module)
            made.append((module, {"name": full, "shape": [module.out_features, module.in_features],
                                  "kernel": module.kernel, "smoothquant_max_scale": (smoothed or {}).get(full),
                                  "weight_rel_error": round(err, 6)}))
        return made

    @torch.no_grad()
    def _smooth(self, job: LayerJob) -> dict[str, float]:
        """SmoothQuant on one layer: statistic from the float layer's inputs, its outputs kept for the next
        layer, scales folded. Returns {linear: largest scale}."""
        head = f"{job.arch.layers}.{job.index}."
        groups = [g for g in self.groups if g.prev.startswith(head)]
        sums: dict[str, torch.Tensor] = {}

        def record(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
            m = sq.window_max(x)  # one window: x (1, T, in)
            sums[name] = sums[name] + m if name in sums else m

        first = {g.linears[0] for g in groups}
        observe = {job.module(n[len(head):]): (lambda x, y, n=n: record(n, x, y)) for n in first}
        job.output_batches = job.forward(observe, keep_outputs=True)  # the float layer's outputs, one per window
        windows = len(job.inputs.hidden)
        smoothed: dict[str, float] = {}
        for g in groups:
            top = sq.smooth_group(job.module(g.prev[len(head):]), [job.module(n[len(head):]) for n in g.linears],
                                  (sums[g.linears[0]] / windows).cpu(), self.cfg.smoothquant_alpha,
                                  job.arch.norm_offset)
            smoothed.update({n: top for n in g.linears})
        return smoothed

    def layer_fn(self) -> LayerFn:
        @torch.no_grad()
        def process(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            smoothed = self._smooth(job) if self.calibrated else None
            rows = [row for _, row in self.quantize(job.layer, f"{job.arch.layers}.{job.index}", smoothed)]
            return {"quantized": len(rows), "int8_rows": rows}, {}

        return process

    @torch.no_grad()
    def outside(self, name: str, module: nn.Module) -> tuple[nn.Module, dict] | None:
        """A targeted linear outside the decoder layers (an output head not ignored): its INT8 module."""
        return self.quantize(module, name)[0] if name in self.targets else None

    def outside_names(self) -> set[str]:
        return set(self.targets)

    def writer(self) -> Int8Writer:
        writer = Int8Writer(self.ctx.model, self.ctx.out_dtype, self.cfg.method, self.targets,
                            int8_activations=self.cfg.method == "w8a8")
        writer.gguf = self.cfg.format == "gguf"  # OUT/model.gguf (Q8_0) once OUT is written (pipeline.py)
        return writer

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        rows = [r for s in layers for r in s.get("int8_rows", [])] + done.outside_rows
        smoothing: dict[str, Any] = {"alpha": None}
        if self.calibrated:
            smoothing = {"alpha": self.cfg.smoothquant_alpha, "data": self.cfg.data or done.calibration_data,
                         "calibration_windows": int(done.windows.shape[0]), "seq_len": int(done.windows.shape[1]),
                         "folded_groups": len(self.groups), "skipped_groups": self.skipped}
        return {"method": self.cfg.method, "weights": "int8 symmetric per output channel",
                "activations": "int8 dynamic per token" if self.cfg.method == "w8a8" else "float (weight-only)",
                "quantized": len(rows), "kept_float": self.kept, "smoothquant": smoothing, "layers": rows}


def select_linears(model: nn.Module, ignore: list[str], check: list[str],
                   tied: str | None) -> tuple[list[str], dict[str, str]]:
    """(names of linears to quantize, {kept linear: why}), `tied` the output head tied to the input embeddings
    (kept in float). A user-given pattern matching no linear is an InputError: it is almost always a typo."""
    patterns = compile_patterns(ignore)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if check:
        check_patterns_match(compile_patterns(check), linears)
    targets, kept = [], {}
    for name in linears:
        hit = next((rx.pattern for rx in patterns if rx.search(name)), None)
        if hit is not None:
            kept[name] = f"ignore '{hit}'"
        elif name == tied:
            kept[name] = "output head tied to the input embeddings"
        else:
            targets.append(name)
    return targets, kept

