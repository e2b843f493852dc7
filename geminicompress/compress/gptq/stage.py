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
(layerwise.computing_in).
The codes/scales/zeros/g_idx are kept and packed at export (formats/).
"""

from __future__ import annotations

from functools import partial
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from geminicompress.compress.gptq.allocate import module_specs, write_allocation
from geminicompress.compress.gptq.solver import gptq_quantize, zeros_to_keep
from geminicompress.compress.grid import QuantizedWeight, QuantSpec
from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.layerwise import LayerJob, layer_output, run_layerwise
from geminicompress.compress.targets import present_groups, weight_quant_targets
from geminicompress.errors import GeminiError, InputError
from geminicompress.formats.checkpoint import check_shapes, scale_dtype, write_quantized

if TYPE_CHECKING:
    from geminicompress.pipeline import StageContext
    from geminicompress.recipes.quantize import GPTQStage


class _Stop(Exception):
    """Raised by a hook once every observed linear has run: the rest of the layer is not needed."""


def run(cfg: GPTQStage, ctx: StageContext) -> dict[str, Any]:
    """Quantize ctx.model in place (fake-quantized weights), set the exporter for cfg.format, and
    return the summary for report.json (per-layer GPTQ losses included). Bad input fails before work."""
    model = ctx.model
    found = weight_quant_targets(model, cfg, ctx.progress, sym=cfg.sym,
                                 fmt=cfg.format if cfg.allocation is None else None)
    arch, targets, shapes, spec = found.arch, found.names, found.shapes, found.spec
    specs, allocation = module_specs(cfg, ctx, targets, spec)  # per module: allocation / overrides (allocate.py)
    for name, s in specs.items():
        if s != spec or cfg.allocation is not None:
            check_shapes(cfg.format, {name: shapes[name]}, s)
    if cfg.act_order == "group":
        ctx.progress.warn("act-order group stores a permuted g_idx, which vLLM refuses (desc_act / actorder group); "
                          "--act-order static (the default) loads everywhere")
    windows = ctx.calibration(cfg.data)  # (n, T)
    widest = max(in_f for _, in_f in shapes.values())
    if windows.numel() < widest:
        raise InputError(f"GPTQ needs at least {widest} calibration tokens (the widest quantized layer's inputs), "
                         f"got {windows.numel()}; raise --samples or --calib-seq-len")

    layers_path = arch.layers + "."
    scales_as = scale_dtype(cfg.format, ctx.recipe.output.dtype)
    relative = {n.removeprefix(layers_path): s for n, s in specs.items() if s != spec}
    process = partial(_quantize_layer, cfg=cfg, spec=spec, scales_as=scales_as,
                      targets={n.removeprefix(layers_path) for n in targets}, specs=relative)
    summaries, kept = run_layerwise(model, windows, process, device=ctx.device, progress=ctx.progress,
                                    state_dir=ctx.state_dir, description=f"gptq {spec.bits}-bit",
                                    calib_dtype=getattr(torch, cfg.calib_dtype))
    qweights = _KeptCodes(kept, spec, layers_path, relative)
    if allocation:
        write_allocation(allocation, specs, ctx.out_dir)
    meta = export_meta(cfg, ctx.recipe.output.dtype)
    ctx.exporter = lambda m, tok, out: write_quantized(m, tok, out, qweights, cfg.format, meta)
    return {
        "bits": spec.bits, "group_size": spec.group_size, "group_size_auto": cfg.group_size == "auto",
        "sym": spec.sym, "format": cfg.format,
        "calibration_tokens": int(windows.numel()), "quantized_modules": len(qweights),
        "total_error": sum(s["err"] for s in summaries), "layers": summaries,
        **({"mixed": {f"b{s.bits}g{s.group_size}": sum(1 for v in specs.values() if v == s) for s in set(specs.values())}}
           if relative else {}),
        **({"allocation": {k: v for k, v in allocation.items() if k != "frontier"}} if allocation else {}),
    }


def export_meta(cfg: GPTQStage, dtype: str) -> dict[str, Any]:
    """What the format writers read of the stage's options (float dtype, act-order, ...)."""
    return {"dtype": dtype, "act_order": cfg.act_order,
            "true_sequential": cfg.true_sequential, "damp": cfg.damp, "first_token_weight": cfg.first_token_weight}


def _quantize_layer(job: LayerJob, *, cfg: GPTQStage, spec: QuantSpec, scales_as: torch.dtype,
                    targets: set[str], specs: dict[str, QuantSpec] | None = None
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Quantize the linears of one decoder layer in place; return ({err, modules}, kept tensors).
    `specs`: "<layer>.<linear>" -> spec where it differs from `spec` (mixed precision)."""
    groups = present_groups(job.arch, lambda n: f"{job.index}.{n}" in targets)
    losses: dict[str, float] = {}
    kept: dict[str, torch.Tensor] = {}
    solve_one = partial(_solve_group, job, cfg=cfg, scales_as=scales_as, losses=losses, kept=kept)

    def solve(group: list[str], H: torch.Tensor) -> None:  # one stacked solve per spec within the group
        by_spec: dict[QuantSpec, list[str]] = {}
        for n in group:
            by_spec.setdefault((specs or {}).get(f"{job.index}.{n}", spec), []).append(n)
        for s, names in by_spec.items():
            solve_one(names, H, spec=s, overwrite=len(by_spec) == 1)  # H is the solver's scratch when used once
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
                 scales_as: torch.dtype, losses: dict[str, float], kept: dict[str, torch.Tensor],
                 overwrite: bool = False) -> None:
    """GPTQ on the group's stacked weight (rows are independent given H); write the fake-quantized
    weights back in place (the loaded weights' memory is reused) and keep the codes for export.
    overwrite: H is not needed afterwards (the solver may use its memory)."""
    modules = [job.module(n) for n in group]
    W = torch.cat([job.weight(n) for n in group])  # rows stacked: (Σ out, in), a new tensor of the master weights
    try:
        qw, loss = gptq_quantize(W, H, spec, damp=cfg.damp, block_size=cfg.block_size, act_order=cfg.act_order,
                                 keep_zero=zeros_to_keep(W, cfg.keep_zeros),
                                 overwrite=overwrite)
    except GeminiError as exc:
        raise GeminiError(f"layer {job.index} {'/'.join(group)}: {exc}") from exc
    qw.scales = qw.scales.to(scales_as).float()  # what the checkpoint will hold
    for name, part in zip(group, qw.split_rows([m.out_features for m in modules])):
        job.set_weight(name, part.dequantize())
        kept.update({f"{name}.{k}": v for k, v in _kept(part).items()})
    losses["/".join(group)] = loss


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
            raise _Stop

    handles = [job.module(g[0]).register_forward_hook(partial(hook, i)) for i, g in enumerate(groups)]
    try:
        with torch.no_grad():
            hidden = job.inputs.hidden
            for i in range(0, len(hidden), batch):
                fired.clear()
                try:
                    h = torch.cat([x.to(job.device) for x in hidden[i:i + batch]])  # (b, T, d)
                    layer_output(job.layer, h, job.inputs.kwargs)
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return [acc.H for acc in accs]


def _kept(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Codes as uint8 while the other layers run (a quarter of int32), two to a byte up to 4 bits (an eighth):
    the kept codes of every layer done so far are alive at the end of calibration, its memory peak."""
    q = qw.q.to(torch.uint8)
    if qw.spec.bits <= 4 and q.shape[1] % 2 == 0:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    fields = {"q": q, "scales": qw.scales, "zeros": qw.zeros.to(torch.uint8), "g_idx": qw.g_idx}
    return {k: v.cpu().clone() for k, v in fields.items()}  # own storage: row slices share the stacked one


def _codes(q: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Undo `_kept`'s nibble packing: (out, in) codes; g_idx has one entry per input column."""
    if q.shape[1] == g_idx.numel():
        return q
    return torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)


class _KeptCodes(Mapping[str, QuantizedWeight]):
    """{full module name: QuantizedWeight} over the "<layer>.<linear>.<field>" tensors kept per layer, built
    on access: the exporter packs one module at a time, so the unpacked codes of one module at a time are
    alive, not those of the whole model next to their packed copies (export is the run's memory peak).

    Codes and zeros stay uint8 (the packers accept any integer dtype): int32 codes of the whole model
    would cost as much memory as its float32 weights."""

    def __init__(self, kept: dict[str, torch.Tensor], spec: QuantSpec, layers_path: str,
                 specs: dict[str, QuantSpec] | None = None) -> None:
        self._kept, self._spec, self._path, self._specs = kept, spec, layers_path, specs or {}
        self._names = sorted({k.rsplit(".", 1)[0] for k in kept}, key=_layer_order)

    def __getitem__(self, key: str) -> QuantizedWeight:
        name = key.removeprefix(self._path)
        if not key.startswith(self._path) or f"{name}.q" not in self._kept:
            raise KeyError(key)
        k = self._kept
        return QuantizedWeight(_codes(k[f"{name}.q"], k[f"{name}.g_idx"]), k[f"{name}.scales"], k[f"{name}.zeros"],
                               k[f"{name}.g_idx"], self._specs.get(name, self._spec))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.startswith(self._path) and f"{key.removeprefix(self._path)}.q" in self._kept

    def __iter__(self) -> Iterator[str]:
        return (self._path + n for n in self._names)

    def __len__(self) -> int:
        return len(self._names)


def _layer_order(name: str) -> tuple[int, str]:
    index, _, rest = name.partition(".")
    return int(index), rest
