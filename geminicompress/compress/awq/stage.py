"""`quantize --method awq|awq+gptq`: AWQ layer by layer, then round-to-nearest or GPTQ, then export.

command -> pipeline -> this stage -> search.py (scales, clips) -> grid.rtn_quantize | gptq_quantize.
Per decoder layer (run_layerwise: one layer and its activations on the device; the quantized layer's
outputs feed the next; resumable through ctx.state_dir):
1. one pass over the calibration windows records, per set of linears reading the same input, mean|x|,
   the Gram matrix H = 2/N Σ xᵀx and a 512-token sample, and the inputs of each `inspect` module on
   the first `search_windows` windows;
2. for each smoothing group of the architecture table (in order): grid-search s = mean|x|^α, fold
   1/s into the previous op and s into the group's linears (groups whose shapes do not allow folding,
   e.g. v_proj -> o_proj under grouped-query attention, are skipped);
3. clipping search per linear (not q/k, whose errors the softmax amplifies; as llm-awq);
4. quantize: RTN (awq) or GPTQ with the Hessians of the scaled inputs (awq+gptq), in place.
With `search_results`, steps 1-3 are replaced by the saved scales and clips (no search).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from geminicompress.compress.awq import results
from geminicompress.compress.awq.config import AWQStage
from geminicompress.compress.awq.search import apply_clip, linear_error, scaled_weights, search_clip, search_scales
from geminicompress.compress.fold import fold_problem, fold_scales
from geminicompress.compress.gptq.solver import gptq_quantize, zeros_to_keep
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.targets import QuantTargets, weight_quant_targets
from geminicompress.core.arch import Arch, SmoothGroup, get_module
from geminicompress.core.grid import KeptCodes, QuantSpec, keep_codes, rtn_quantize
from geminicompress.engine.contract import Done, LayerStage, StageContext
from geminicompress.engine.layers import LayerFn, LayerJob
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.formats import writer_for
from geminicompress.formats.checkpoint import scale_dtype

CLIP_TOKENS = 512
NO_CLIP = ("q_proj", "k_proj", "query_key_value")  # their outputs meet in q·kᵀ (llm-awq skips them too)


def refuse_unfed(arch: Arch, model_type: str) -> None:
    """AWQ folds its scales into the op in front of each group; a block whose first linears read the layer's
    input with no norm in front (post-norm blocks, OLMo 2's) has nowhere to fold them: refuse, in one line."""
    first = arch.sequential[0]
    if first in arch.unfed:
        names = ", ".join(first)
        raise InputError(f"awq: in a '{model_type}' decoder layer {names} read the layer's input with no norm in front "
                         f"to fold AWQ's scales into (missing feed: norm -> {first[0]}); rtn, gptq, int8 and w8a8 "
                         "quantization and every pruning method still work")


class AWQ(LayerStage):
    """AWQ / AWQ+GPTQ as the engine runs it: steps 1-4 on each layer (`_awq_layer`), the codes packed per layer
    by the format's writer, the search results (scales, clips: small) held until the end and saved in
    OUT/awq_search/ (a saved search re-applied instead with `search_results`)."""

    calibrated = True
    quantizes = True
    squares = 2  # float32 (in)² buffers at its peak (estimate.py)
    retains = True  # its search results are held until the summary (retain)
    rounds_floats = True  # folds its scales into float norms: written in a lower dtype, they round (resume: run.py)

    @staticmethod
    def find_targets(model: Any, cfg: AWQStage, progress: Any, planned: QuantTargets | None = None) -> QuantTargets:
        """Its targets and spec (targets.py): made by preflight on the model's skeleton (`planned`: None), then
        taken from that plan when the stage opens."""
        return weight_quant_targets(model, cfg, progress, sym=not cfg.zero_point, fmt=cfg.format, planned=planned)

    def __init__(self, cfg: AWQStage, ctx: StageContext) -> None:
        found = self.find_targets(ctx.model, cfg, ctx.progress, ctx.plan.of(cfg))
        refuse_unfed(found.arch, ctx.model.config.model_type)
        self.cfg, self.ctx, self.spec, self.targets = cfg, ctx, found.spec, found.names
        self.num_layers = len(get_module(ctx.model, found.arch.layers))
        self.model_type = ctx.model.config.model_type
        saved = (results.load_search(cfg.search_results, self.model_type, self.num_layers)[0]
            if cfg.search_results else None)
        self.layers_path = found.arch.layers + "."
        self.process = partial(_awq_layer, cfg=cfg, spec=self.spec, saved=saved, norm_offset=found.arch.norm_offset,
                               scales_as=scale_dtype(cfg.format, str(ctx.out_dtype).removeprefix("torch.")),
                               targets={n.removeprefix(self.layers_path) for n in self.targets})

    def layer_fn(self) -> LayerFn:
        return self.process

    def retain(self, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a streamed run holds of a finished layer until the summary: its search results."""
        return {k: v for k, v in kept.items() if not k.startswith("qw.")}

    def qweights(self, i: int, kept: dict[str, torch.Tensor]) -> KeptCodes:
        """Layer i's quantized linears from its kept "qw.<linear>.<field>" tensors, by linear name."""
        names = sorted({k.rsplit(".", 1)[0].removeprefix("qw.") for k in kept if k.startswith("qw.")})
        return KeptCodes(kept, {f"{self.layers_path}{i}.{n}": (f"qw.{n}", self.spec) for n in names})

    def writer(self) -> Any:
        dtype = str(self.ctx.out_dtype).removeprefix("torch.")
        meta = {"dtype": dtype, "zero_point": self.cfg.zero_point, "method": self.cfg.method}
        return writer_for(self.cfg.format, self.ctx.model, self.ctx.out_dtype, {n: self.spec for n in self.targets},
                          meta, self.qweights)

    def summary(self, layers: list[dict], done: Done) -> dict[str, Any]:
        cfg, spec, windows = self.cfg, self.spec, done.windows
        meta = {"model_type": self.model_type, "num_layers": self.num_layers, "method": cfg.method, "bits": spec.bits,
                "group_size": spec.group_size, "zero_point": cfg.zero_point, "n_grid": cfg.n_grid,
                "clip": cfg.clip, "search_windows": cfg.search_windows,
                "calibration_windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
                "reapplied_from": cfg.search_results}  # awq_search.json: what the saved search was made for
        results.save_search(done.out_dir, results.search_tensors(done.kept), meta)
        return {
            "bits": spec.bits, "group_size": spec.group_size, "group_size_auto": cfg.group_size == "auto",
            "zero_point": cfg.zero_point, "format": cfg.format,
            "calibration_tokens": int(windows.numel()), "quantized_modules": len(self.targets),
            "search": "reapplied" if cfg.search_results else "searched",
            "search_file": f"{results.FOLDER}/{results.TENSORS}", "layers": layers,
        }


@dataclass
class _InputStats:
    """What step 1 keeps about the input x (tokens, in) shared by one set of linears."""

    abs_sum: torch.Tensor | None = None
    tokens: int = 0
    hessian: HessianAccumulator | None = None
    sample: list[torch.Tensor] = field(default_factory=list)

    @property
    def mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)


def _collect(job: LayerJob, search_windows: int, want_hessian: set[str], want_search: bool
             ) -> tuple[dict[str, _InputStats], dict[str, list[tuple[tuple, dict]]]]:
    """Step 1: statistics of each linear set's input, and the inspect modules' inputs."""
    stats: dict[str, _InputStats] = {}
    total = sum(h.shape[0] * h.shape[1] for h in job.inputs.hidden)
    stride = max(1, total // CLIP_TOKENS)

    def observe(key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (t, in)
        st = stats.setdefault(key, _InputStats())
        st.abs_sum = x.abs().sum(0) if st.abs_sum is None else st.abs_sum + x.abs().sum(0)
        st.tokens += x.shape[0]
        if key in want_hessian:
            st.hessian = st.hessian or HessianAccumulator(x.shape[1], x.device)
            st.hessian.add_batch(x)
        if want_search:
            st.sample.append(x[::stride])

    inspect_inputs: dict[str, list[tuple[tuple, dict]]] = {}
    handles = []
    if want_search:
        names = {g.inspect for g in job.arch.smooth if not isinstance(job.module(g.inspect), nn.Linear)}
        for name in names:
            seen = inspect_inputs.setdefault(name, [])

            def pre_hook(module: nn.Module, args: tuple, kwargs: dict, seen=seen) -> None:
                if len(seen) < search_windows:
                    seen.append((args, kwargs))

            handles.append(job.module(name).register_forward_pre_hook(pre_hook, with_kwargs=True))
    observers = {job.module(g[0]): partial(observe, g[0]) for g in job.arch.sequential}
    try:
        job.forward(observers)
    finally:
        for handle in handles:
            handle.remove()
    return stats, inspect_inputs


def _module_error(module: nn.Module, linears: list[nn.Linear], spec: QuantSpec, inputs: list[tuple[tuple, dict]]):
    """`error(s)`: mean squared change of `module`'s output when its linears hold Q(W·s)/s."""
    weights = [lin.weight.data for lin in linears]
    with torch.no_grad():
        refs = [_first(module(*args, **kwargs)) for args, kwargs in inputs]

    def error(s: torch.Tensor) -> float:
        total, count = 0.0, 0
        try:
            for lin, wq in zip(linears, scaled_weights(weights, s, spec)):
                lin.weight.data = wq
            with torch.no_grad():
                for (args, kwargs), ref in zip(inputs, refs):
                    total += float((_first(module(*args, **kwargs)) - ref).float().pow(2).sum())
                    count += ref.numel()
        finally:
            for lin, w in zip(linears, weights):
                lin.weight.data = w
        return total / max(count, 1)

    return error


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _awq_layer(job: LayerJob, *, cfg: AWQStage, spec: QuantSpec, saved: dict[str, torch.Tensor] | None, norm_offset: float,
               scales_as: torch.dtype, targets: set[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Steps 1-4 for one decoder layer, in place; returns (summary, kept tensors)."""
    arch = job.arch
    quantized = [n for n in arch.linears if f"{job.index}.{n}" in targets]
    searching = saved is None
    linear_inspect = {g.linears[0] for g in arch.smooth if isinstance(job.module(g.inspect), nn.Linear)}
    want_hessian = {g[0] for g in arch.sequential} if cfg.method == "awq+gptq" else linear_inspect
    stats, inspect_inputs = (_collect(job, cfg.search_windows, want_hessian, searching)
        if searching or cfg.method == "awq+gptq" else ({}, {}))
    saved_smooth, saved_clip = results.layer_results(saved, job.index) if saved is not None else ({}, {})
    input_of = {name: group[0] for group in arch.sequential for name in group}
    divided: dict[str, torch.Tensor] = {}  # input set -> s its input is now divided by
    kept: dict[str, torch.Tensor] = {}
    summary: dict[str, Any] = {}
    for group in arch.smooth:
        if not any(n in quantized for n in group.linears):
            continue
        prev, linears = job.module(group.prev), [job.module(n) for n in group.linears]
        problem = fold_problem(prev, linears)
        if problem:
            summary[f"{group.prev}->"] = f"skipped: {problem}"
            continue
        if searching:
            s, alpha, err, rtn_err = _search_group(job, group, linears, spec, cfg.n_grid, stats, inspect_inputs)
            summary[f"{group.prev}->"] = {"alpha": alpha, "error": err, "rtn_error": rtn_err}
        elif group.prev in saved_smooth:
            s = saved_smooth[group.prev].to(job.device)
        else:
            continue
        fold_scales(prev, linears, s, norm_offset)
        divided[input_of[group.linears[0]]] = s
        kept[f"smooth.{group.prev}"] = s.detach().cpu()
    for name in quantized:
        bound = (_clip_bound(job, name, spec, cfg.clip, stats, divided.get(input_of[name])) if searching
            else saved_clip.get(name))
        if bound is not None:
            weight = job.module(name).weight
            weight.data = apply_clip(weight.data, bound.to(weight.device))
            kept[f"clip.{name}"] = bound.detach().cpu()
    kept.update(_quantize(job, cfg, spec, quantized, stats, divided, scales_as))
    errors = [v for v in summary.values() if isinstance(v, dict) and v["rtn_error"] > 0]
    if errors:
        summary["err_ratio"] = sum(v["error"] / v["rtn_error"] for v in errors) / len(errors)
    return summary, kept


def _search_group(job: LayerJob, group: SmoothGroup, linears: list[nn.Linear], spec: QuantSpec, n_grid: int,
                  stats: dict[str, _InputStats], inspect_inputs: dict) -> tuple[torch.Tensor, float, float, float]:
    st = stats[group.linears[0]]
    inspect = job.module(group.inspect)
    if isinstance(inspect, nn.Linear):
        if st.hessian is None:
            raise GeminiError(f"layer {job.index}: no activations were recorded for {group.linears[0]}")
        error = linear_error([lin.weight.data for lin in linears], st.hessian.H, spec)
    else:
        error = _module_error(inspect, linears, spec, inspect_inputs[group.inspect])
    return search_scales(st.mean, error, n_grid)


def _clip_bound(job: LayerJob, name: str, spec: QuantSpec, clip: bool, stats: dict[str, _InputStats],
                s: torch.Tensor | None) -> torch.Tensor | None:
    if not clip or name.rsplit(".", 1)[-1] in NO_CLIP:
        return None
    weight = job.module(name).weight.data
    if not spec.whole_groups(weight.shape[1]):  # the search clips whole groups (a dense OUT allows a partial one)
        return None
    group = next(g for g in job.arch.sequential if name in g)
    x = torch.cat(stats[group[0]].sample)  # (≈512, in)
    if s is not None:
        x = x / s
    return search_clip(weight, x, spec)


def _quantize(job: LayerJob, cfg: AWQStage, spec: QuantSpec, quantized: list[str], stats: dict[str, _InputStats],
              divided: dict[str, torch.Tensor], scales_as: torch.dtype) -> dict[str, torch.Tensor]:
    """Step 4: RTN or GPTQ per set of linears sharing an input; write the dequantized weights back."""
    kept: dict[str, torch.Tensor] = {}
    for group in job.arch.sequential:
        names = [n for n in group if n in quantized]
        if not names:
            continue
        modules = [job.module(n) for n in names]
        W = torch.cat([m.weight.data for m in modules])  # (Σ out, in)
        if cfg.method == "awq+gptq":
            H = stats[group[0]].hessian.H
            s = divided.get(group[0])
            if s is not None:
                H = H / torch.outer(s, s)  # inputs x/s: H_ij / (s_i s_j)
            try:
                qw, _ = gptq_quantize(W, H, spec, damp=cfg.damp, block_size=cfg.block_size,
                                      keep_zero=zeros_to_keep(W, cfg.keep_zeros))
            except GeminiError as exc:
                raise GeminiError(f"layer {job.index} {'/'.join(names)}: {exc}") from exc
        else:
            qw = rtn_quantize(W, spec)
        qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
        for name, module, part in zip(names, modules, qw.split_rows([m.out_features for m in modules])):
            module.weight.data = part.dequantize().to(module.weight.dtype)
            kept.update(keep_codes(part, f"qw.{name}"))
    return kept
