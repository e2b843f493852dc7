"""`quantize --method gptq`: GPTQ layer by layer, then export in the chosen format.

command -> pipeline -> this stage -> `solver.gptq_quantize`. Per decoder layer (run_layerwise: only
that layer and its activations on the device; quantized outputs feed the next layer; resumable):
1. register hooks that accumulate one Hessian per group of linears reading the same input
   (q/k/v share one; gate/up share one), running the layer only as far as those linears;
2. solve the group as one stacked weight (GPTQ's rows are independent given H), write the
   fake-quantized weights back so later groups and layers see the quantized model;
3. with `true_sequential` each group of `arch.sequential` is collected after the previous one is
   quantized (the paper's order): by default in one pass over the windows that pauses before each
   group (onepass.py), or with `one_pass` off by re-running the layer per group (less memory);
   without `true_sequential`, all Hessians of the layer come from one pass of the unquantized layer.
With `calib_dtype: bfloat16` the layer's forward passes compute in bfloat16 while the Hessians are
float32 products of those activations and the solver reads and writes float32 master weights
(engine/layers.py, `computing_in`).
The codes/scales/zeros/g_idx are kept and packed at export (formats/).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from geminicompress.compress import gguf_types
from geminicompress.compress.gptq.allocate import gguf_auto_types, module_specs, write_allocation
from geminicompress.compress.gptq.kgrid_solve import gptq_kquant
from geminicompress.compress.gptq.config import GPTQStage
from geminicompress.compress.gptq.solver import SolverOptions, gptq_quantize, zeros_to_keep
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.scale_search import ScaleSearch
from geminicompress.compress.targets import QuantTargets, present_groups, weight_quant_targets
from geminicompress.core.gguf_config import AUTO
from geminicompress.core.grid import KeptCodes, QuantSpec, keep_codes
from geminicompress.engine.compose import OnePassFn
from geminicompress.engine.contract import Done, LayerStage, StageContext
from geminicompress.engine.layers import LayerFn, LayerJob, StopForward, layer_output
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats import check_shapes, writer_for
from geminicompress.formats.checkpoint import scale_dtype
from geminicompress.formats.gguf_blocks import BlocksWriter


class GPTQ(LayerStage):
    """GPTQ as the engine runs it: the layer's groups solved by `quantize_layer`, its codes kept and packed
    per layer by the format's writer. Opening (before any work): targets, the spec (group size "auto"
    resolved), per-module specs of an allocation or overrides (allocate.py: a pre-pass), the format's shape
    checks, enough calibration tokens."""

    calibrated = True
    quantizes = True
    squares = 1  # float32 (in)² buffers at its peak: the Hessian, the in-place inverse factor's scratch

    @staticmethod
    def cannot_stream(cfg: GPTQStage, first: bool) -> str | None:
        if cfg.allocation is not None and cfg.allocation.sensitivity is None:
            return ("gptq mixed precision measures its sensitivity table with the model in memory; give a table "
                    "(--sensitivity sensitivity.json, from `geminicompress sensitivity`) or run it with --no-stream")
        return None

    @staticmethod
    def find_targets(model: Any, cfg: GPTQStage, progress: Any, planned: QuantTargets | None = None) -> QuantTargets:
        """Its targets and spec (targets.py): made by preflight on the model's skeleton (`planned`: None), then
        taken from that plan when the stage opens. Mixed precision checks its shapes per module, once its
        specs are known."""
        fmt = cfg.format if cfg.allocation is None else None
        return weight_quant_targets(model, cfg, progress, sym=cfg.sym, fmt=fmt, planned=planned)

    def __init__(self, cfg: GPTQStage, ctx: StageContext) -> None:
        self.one_pass_memory = cfg.true_sequential and cfg.one_pass
        found = self.find_targets(ctx.model, cfg, ctx.progress, ctx.plan.of(cfg))
        self.cfg, self.ctx, self.spec, self.targets = cfg, ctx, found.spec, found.names
        if cfg.gguf_type == AUTO:  # each linear's type by the allocation (allocate.py)
            self.gguf_types, self.allocation = gguf_auto_types(cfg, ctx, found.names)
        else:  # --gguf-type MIX: llama-quantize's types
            self.gguf_types, self.allocation = gguf_types.plan(cfg, ctx.model, found.shapes, calibrated=True), {}
        if self.gguf_types is not None:
            self.targets = [n for n in found.names if n in self.gguf_types]
            self.specs = {n: gguf_types.spec_for(self.gguf_types[n]) for n in self.targets}
        else:
            self.specs, self.allocation = module_specs(cfg, ctx, found.names, found.spec)  # allocate.py
        for name, s in self.specs.items():
            if (s != self.spec or cfg.allocation is not None) and s.grid is None:
                check_shapes(cfg.format, {name: found.shapes[name]}, s)
        if cfg.act_order == "group":
            ctx.progress.warn("act-order group stores a permuted g_idx, which vLLM refuses (desc_act / actorder group); "
                              "--act-order static (the default) loads everywhere")
        windows = ctx.calibration(cfg.data)  # (n, T)
        widest = max(in_f for _, in_f in found.shapes.values())
        if windows.numel() < widest:
            raise InputError(f"GPTQ needs at least {widest} calibration tokens (the widest quantized layer's "
                             f"inputs), got {windows.numel()}; raise --samples or --calib-seq-len")
        self.layers_path = found.arch.layers + "."
        self.relative = {n.removeprefix(self.layers_path): s for n, s in self.specs.items() if s != self.spec}
        self.dtypes = gptq_dtypes(cfg, ctx.source_dtype, ctx.out_dtype)

    def layer_fn(self) -> LayerFn:
        """`quantize_layer`; with true-sequential in one pass it shares that pass with a one-pass stage
        before it in a streamed recipe (e.g. SparseGPT: engine/compose.py)."""
        process = partial(quantize_layer, cfg=self.cfg, spec=self.spec,
                          scales_as=scale_dtype(self.cfg.format, str(self.ctx.out_dtype).removeprefix("torch.")),
                          targets={n.removeprefix(self.layers_path) for n in self.targets}, specs=self.relative,
                          gguf={n.removeprefix(self.layers_path): t for n, t in self.gguf_types.items()}
                          if self.gguf_types is not None else None)
        return OnePassFn(process) if self.cfg.true_sequential and self.cfg.one_pass else process

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> KeptCodes:
        """Layer i's quantized linears from the codes the step kept (unpacked one module at a time), by name."""
        head, names = f"{self.layers_path}{i}.", sorted({k.rsplit(".", 1)[0] for k in kept})
        return KeptCodes(kept, {head + n: (n, self.specs[head + n]) for n in names})

    def writer(self) -> Any:
        if self.gguf_types is not None:  # dense checkpoint + the blocks (formats/gguf_blocks.py)
            return BlocksWriter(self.ctx.model, self.ctx.out_dtype, self.gguf_types)
        cfg = self.cfg  # what the format writers read of the stage's options
        meta = {"dtype": str(self.ctx.out_dtype).removeprefix("torch."), "act_order": cfg.act_order,
                "true_sequential": cfg.true_sequential, "damp": cfg.damp, "first_token_weight": cfg.first_token_weight}
        return writer_for(cfg.format, self.ctx.model, self.ctx.out_dtype, self.specs, meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        if self.allocation:
            write_allocation(self.allocation, self.specs, done.out_dir)
        spec, specs = self.spec, self.specs
        return {
            "bits": spec.bits, "group_size": spec.group_size, "group_size_auto": self.cfg.group_size == "auto",
            "sym": spec.sym, "format": self.cfg.format, **({"gguf_type": self.cfg.gguf_type} if self.gguf_types else {}),
            "calibration_tokens": int(done.windows.numel()), "quantized_modules": len(self.targets),
            "calib_dtype": str(done.calib_dtype).removeprefix("torch."),
            "total_error": sum(s.get("err", 0.0) for s in layers), "layers": layers,
            **({"mixed": {f"b{s.bits}g{s.group_size}": sum(1 for v in specs.values() if v == s) for s in set(specs.values())}}
               if self.relative else {}),
            **({"allocation": {k: v for k, v in self.allocation.items() if k not in ("frontier", "table")}}
               if self.allocation else {}),
        }


def gptq_dtypes(cfg: GPTQStage, source: torch.dtype, out_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the layers compute in while calibrating, dtype of the weights the solver reads and writes),
    for a model stored in `source` and written in `out_dtype`.

    A bfloat16 checkpoint calibrates in bfloat16 unless --calib-dtype says otherwise: its activations
    take half the memory (32 x 512 windows of an 8B model: 0.9 instead of 1.7 GB held in one pass). When
    the output is bfloat16 too, float32 master weights would only hold values that are rounded to the
    bfloat16 the layer computes with anyway (the input exactly, the solved weights when written), so the
    layer stays bfloat16: the same tensors as a float32 run with `--calib-dtype bfloat16`, bitwise (tested).
    Otherwise the layer is float32 (a model in memory is held in float32)."""
    calib = getattr(torch, cfg.calib_dtype)
    if "calib_dtype" not in cfg.model_fields_set and source == torch.bfloat16:
        calib = torch.bfloat16
    exact = calib == out_dtype == source == torch.bfloat16
    return calib, torch.bfloat16 if exact else torch.float32


def quantize_layer(job: LayerJob, *, cfg: GPTQStage, spec: QuantSpec, scales_as: torch.dtype,
                    targets: set[str], specs: dict[str, QuantSpec] | None = None, gguf: dict[str, str] | None = None
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Quantize the linears of one decoder layer in place; return ({err, modules}, kept tensors).
    `specs`: "<layer>.<linear>" -> spec where it differs from `spec` (mixed precision); `gguf`: "<layer>.<linear>"
    -> its GGUF type under --gguf-type (the blocks are kept)."""
    groups = present_groups(job.arch, lambda n: f"{job.index}.{n}" in targets)
    losses: dict[str, float] = {}
    kept: dict[str, torch.Tensor] = {}

    def solve_one(names: list[str], H: torch.Tensor, spec: QuantSpec, overwrite: bool) -> None:
        loss, codes = _solve_group(job, names, H, cfg=cfg, spec=spec, scales_as=scales_as, overwrite=overwrite,
                                   gguf=None if gguf is None else {n: gguf[f"{job.index}.{n}"] for n in names})
        losses["/".join(names)] = loss
        kept.update(codes)

    def solve(group: list[str], H: torch.Tensor) -> None:  # one stacked solve per spec within the group
        by_spec: dict[QuantSpec, list[str]] = {}
        for n in group:
            by_spec.setdefault((specs or {}).get(f"{job.index}.{n}", spec), []).append(n)
        for s, names in by_spec.items():
            solve_one(names, H, s, overwrite=len(by_spec) == 1)  # H is the solver's scratch when used once
    if cfg.true_sequential and cfg.one_pass:
        # each group's Hessian exists from its first input to its solve only (down_proj's is the biggest)
        accs: dict[int, HessianAccumulator] = {}

        def observe(i: int, x: torch.Tensor) -> None:
            if i not in accs:
                accs[i] = HessianAccumulator(job.module(groups[i][0]).in_features, job.device, cfg.first_token_weight)
            accs[i].add_batch(x)

        job.one_pass(groups, observe, lambda i: solve(groups[i], accs.pop(i).H))
    else:
        passes = [[g] for g in groups] if cfg.true_sequential else [groups]
        for pass_groups in passes:
            hessians = _collect_hessians(job, pass_groups, cfg.first_token_weight)
            for group in pass_groups:
                solve(group, hessians.pop(0))  # each Hessian freed once solved
    return {"err": sum(losses.values()), "modules": losses}, kept


def _solve_group(job: LayerJob, group: list[str], H: torch.Tensor, *, cfg: GPTQStage, spec: QuantSpec,
                 scales_as: torch.dtype, overwrite: bool = False,
                 gguf: dict[str, str] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """GPTQ on the group's stacked weight (rows are independent given H); write the fake-quantized
    weights back in place (the loaded weights' memory is reused); return the loss and the codes to keep
    for export. overwrite: H is not needed afterwards (the solver may use its memory). gguf: each linear's
    GGUF type under --gguf-type: its blocks are kept, and llama.cpp's weights of them written back."""
    modules = [job.module(n) for n in group]
    W = torch.cat([job.weight(n) for n in group])  # rows stacked: (Σ out, in), a new tensor of the master weights
    sizes = [m.out_features for m in modules]
    try:
        if spec.grid is not None:  # a K / IQ4 grid (compress/gptq/kgrid_solve.py)
            codes, loss = gptq_kquant(W, H, spec.grid, cfg.damp)
            parts = np.split(gguf_types.blocks_of(codes, spec.grid), np.cumsum(sizes)[:-1])
        else:
            qw, loss = gptq_quantize(W, H, spec, solver_options(cfg, spec),
                                     keep_zero=zeros_to_keep(W, cfg.keep_zeros), overwrite=overwrite)
    except GeminiError as exc:
        raise GeminiError(f"layer {job.index} {'/'.join(group)}: {exc}") from exc
    kept: dict[str, torch.Tensor] = {}
    if spec.grid is None:
        qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
        parts = qw.split_rows(sizes)
    if gguf is not None:
        for name, part in zip(group, parts):
            blocks = part if spec.grid is not None else gguf_types.blocks_of(part, gguf[name])
            w_hat, keep = gguf_types.keep_blocks(blocks, gguf[name], name)
            job.set_weight(name, w_hat)
            kept.update(keep)
        return loss, kept
    for name, part in zip(group, parts):
        job.set_weight(name, part.dequantize())
        kept.update(keep_codes(part, name))
    return loss, kept


# what --scale-search weighted uses: llama.cpp's Q4_0 weighting of the importance matrix (the Hessian's diagonal,
# the mean squared input, times sqrt(σ²_row + w²)); measured on the demo against the diagonal alone (docs/llama-cpp.md)
WEIGHTED = "llama"


def solver_options(cfg: GPTQStage, spec: QuantSpec) -> SolverOptions:
    """What the solver is told by the stage's config for one spec. A trial search needs each group's columns
    solved one after the other: with act order static, groups go by their largest H_jj, act order inside each
    (GPTQModel's group-aware order, "gar")."""
    search = scale_search(cfg, spec)
    order = "gar" if search is not None and search.trial and cfg.act_order == "static" else "global"
    return SolverOptions(damp=cfg.damp, block_size=cfg.block_size, act_order=cfg.act_order, order=order,
                         search=search)


# what `auto` means for --format gguf (measured on the demo: docs/formats.md, GGUF ablation)
AUTO_GGUF = "trial"
# the trial's shrink/stretch factors of the signed base scale (measured on the demo: a wider range won, docs/formats.md)
TRIAL_FACTORS = {"lo": 0.3, "hi": 1.6, "grid": 130}


def scale_search(cfg: GPTQStage, spec: QuantSpec) -> ScaleSearch | None:
    """The stage's scale choice for symmetric groups, `auto` resolved: for --format gguf, signed scales searched
    under the weighted error (llama.cpp's own Q4_0/Q5_0 choice, here inside GPTQ's error feedback); otherwise the
    range's scale as before (None: the checkpoints of the other formats keep their bytes)."""
    if not spec.sym:
        return None
    gguf = cfg.format == "gguf"
    mode = cfg.scale_search if cfg.scale_search != "auto" else (AUTO_GGUF if gguf else "none")
    signed = cfg.signed_scales if cfg.signed_scales is not None else gguf
    if mode == "none" and not signed:
        return None
    weights = {"none": None, "plain": "plain", "weighted": WEIGHTED, "trial": WEIGHTED}[mode]
    if mode == "trial":
        return ScaleSearch(signed=signed, weights=weights, trial=True, **TRIAL_FACTORS)
    return ScaleSearch(signed=signed, weights=weights)


def _collect_hessians(job: LayerJob, groups: list[list[str]], first_token_weight: float = 1.0,
                      batch: int = 4) -> list[torch.Tensor]:
    """One Hessian per group, hooked on the group's first linear (all members read the same input).
    Windows run `batch` at a time, and the layer only until every hooked linear has seen them."""
    accs = [HessianAccumulator(job.module(g[0]).in_features, job.device, first_token_weight) for g in groups]
    fired: set[int] = set()

    def hook(i: int, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        accs[i].add_batch(args[0].detach())
        fired.add(i)
        if len(fired) == len(accs):
            raise StopForward  # every hooked linear has run: the rest of the layer is not needed

    handles = [job.module(g[0]).register_forward_hook(partial(hook, i)) for i, g in enumerate(groups)]
    try:
        with torch.no_grad():
            hidden = job.inputs.hidden
            for i in range(0, len(hidden), batch):
                fired.clear()
                try:
                    h = torch.cat([x.to(job.device) for x in hidden[i:i + batch]])  # (b, T, d)
                    layer_output(job.layer, h, job.inputs.kwargs)
                except StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return [acc.H for acc in accs]

