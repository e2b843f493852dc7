"""The sensitivity pass: the drift each candidate setting causes on each module (or fused group) alone.

For every unit u (a decoder linear, or with `fuse` a group of linears reading one input: q/k/v,
gate/up) and option o, apply o to u only, all else untouched, and measure
- kl: KL(original ‖ modified) of the next-token distributions at the model output, nats per token,
  averaged over the first `kl_windows` calibration windows: the modified layer is run from the cached
  original hidden states at its input, then the rest of the model (only the layers from u's on);
- proxy (cheap: one layer forward per unit and option): the squared error u's option causes at its
  decoder layer's output, e_uo = mean_t ‖Δh_t‖², times a propagation gain of that depth,
  γ_l = KL / e measured once per layer by adding small isotropic noise (relative size `noise`) to the
  original layer output. KL is quadratic in a small perturbation of the residual stream, so γ·e is in
  the same units as kl.
Statistics (GPTQ/SparseGPT Hessians, Wanda input norms) come from all calibration windows through the
original model, layer by layer: the engine's walk (engine/walk.py), whose per-layer function also measures
the layer's units. A whole-model pass by design: measuring at the output needs every layer after u (STYLE
14's exception), so the model must be in memory (a streamed run refuses to measure a table; it can use one),
and it sits on the device for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from geminicompress.compress.hessian import HessianAccumulator
from geminicompress.compress.prune.wanda import InputNorms
from geminicompress.compress.sensitivity.options import Option, apply_option, check_applicable
from geminicompress.compress.targets import present_groups
from geminicompress.core.arch import Arch, arch_for, get_module
from geminicompress.core.metrics import kl_per_token
from geminicompress.engine.layers import LayerJob, capture_inputs, forward_layer, layer_output
from geminicompress.engine.walk import WalkOptions, run_layerwise
from geminicompress.core.errors import InputError
from geminicompress.models.head import chunk_logits
from geminicompress.host.progress import NullProgress, Progress

MEASURES = ("kl", "proxy", "both")


@dataclass(frozen=True)
class Unit:
    layer: int
    linears: tuple[str, ...]  # relative to the decoder layer, e.g. ("self_attn.q_proj",)


def units_of(arch: Arch, n_layers: int, keep: set[str], fuse: bool) -> list[Unit]:
    """Units in model order; `keep`: the full module names that may be changed."""
    units = []
    for i in range(n_layers):
        for group in arch.sequential:
            names = tuple(n for n in group if f"{arch.layers}.{i}.{n}" in keep)
            if fuse and names:
                units.append(Unit(i, names))
            else:
                units.extend(Unit(i, (n,)) for n in names)
    return units


def read_table(path: str | Path) -> dict[str, Any]:
    """A sensitivity.json written by `measure_sensitivity`'s caller (`geminicompress sensitivity`); one-line errors."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"sensitivity table {path} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not a sensitivity.json: {exc}") from exc


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (ties broken by order)."""
    ra = np.argsort(np.argsort(np.asarray(a))).astype(float)
    rb = np.argsort(np.argsort(np.asarray(b))).astype(float)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


class _Tail:
    """Layers l.. then the final norm and the model's own head, from cached original hidden states (kw, T, d),
    and KL to the original model's output. The head runs over chunks of positions (models/head.py), so a
    large vocabulary never makes a (kw·(T−1), V) tensor: the original's log-probs are kept when they fit
    `KEEP_BYTES`, else recomputed chunk by chunk from its final hidden states (exact either way)."""

    KEEP_BYTES = 256 * 2**20

    def __init__(self, model: nn.Module, arch: Arch, layer_kwargs: list[dict[str, Any]]) -> None:
        self.model = model
        self.layers = get_module(model, arch.layers)
        self.norm = get_module(model, arch.final_norm)
        self.layer_kwargs = layer_kwargs  # what the model hands each decoder layer
        self.base_states: torch.Tensor | None = None  # (kw·(T−1), d) the original's, after the final norm
        self.base_logprobs: list[torch.Tensor] | None = None  # its (c, V) chunks, when they fit KEEP_BYTES

    def states(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """(kw·(T−1), d): h (kw, T, d) through layers start.. and the final norm, the scored positions."""
        for i in range(start, len(self.layers)):
            h = layer_output(self.layers[i], h, self.layer_kwargs[i])
        return self.norm(h)[:, :-1].flatten(0, 1)

    def chunks(self, states: torch.Tensor) -> Iterator[torch.Tensor]:
        for _, logits in chunk_logits(self.model, states):  # (c, V)
            yield F.log_softmax(logits, dim=-1)

    def set_reference(self, h: torch.Tensor, start: int) -> None:
        """The original model's output, from its states h at the input of layer `start`."""
        self.base_states = self.states(h, start)
        keep = self.base_states.shape[0] * self.model.config.vocab_size * 4 <= self.KEEP_BYTES
        self.base_logprobs = list(self.chunks(self.base_states)) if keep else None

    def kl(self, h: torch.Tensor, start: int) -> float:
        """Mean KL(original ‖ this) per scored position, h (kw, T, d) at the input of layer `start`."""
        assert self.base_states is not None, "set_reference first"
        base = self.base_logprobs if self.base_logprobs is not None else self.chunks(self.base_states)
        total, count = 0.0, 0
        for b, q in zip(base, self.chunks(self.states(h, start))):
            total += float(kl_per_token(b, q).double().sum())
            count += q.shape[0]
        return total / count


@dataclass(frozen=True)
class SensitivitySettings:
    """How `measure_sensitivity` measures. keep: the linears to measure. kl_windows: the windows the drift is
    measured on. measure: "proxy", "kl" or "both". fuse: a unit is a group of linears reading one input.
    noise: the relative size of the perturbation that measures each layer's propagation gain. `act_order` and
    `first_token_weight` (the weight of each window's first token in the Hessians) are the gptq options'
    solver settings: the gptq stage's defaults, so that the table measures what the stage will apply
    (sparsegpt options always use the unweighted Hessian, as the prune stage does)."""

    keep: set[str]
    kl_windows: int = 2
    measure: str = "proxy"
    fuse: bool = False
    noise: float = 0.02
    device: torch.device = torch.device("cpu")
    progress: Progress | None = None
    seed: int = 0
    act_order: bool = True
    first_token_weight: float = 16.0


@dataclass(frozen=True)
class _Measuring:
    """What every unit of one table is measured with."""

    options: list[Option]
    states: list[torch.Tensor]
    tail: _Tail
    measure: str
    arch: Arch
    bar: Any
    act_order: bool


@torch.no_grad()
def measure_sensitivity(model: nn.Module, windows: torch.Tensor, options: list[Option],
                        settings: SensitivitySettings) -> dict[str, Any]:
    """The table (sensitivity.json's content): one row per unit, one column per option. settings: how it
    measures (`SensitivitySettings`: at least the linears to keep)."""
    st = settings
    measure, device = st.measure, st.device
    if measure not in MEASURES:
        raise InputError(f"measure '{measure}' is not one of {', '.join(MEASURES)}")
    progress = st.progress or NullProgress()
    arch = arch_for(model)
    layers = get_module(model, arch.layers)
    units = units_of(arch, len(layers), st.keep, st.fuse)
    if not units:
        raise InputError("no decoder linear left to measure (check --ignore)")
    in_features = {f"{arch.layers}.{u.layer}.{n}": get_module(layers[u.layer], n).in_features for u in units for n in u.linears}
    check_applicable(options, in_features)
    kw = max(1, min(st.kl_windows, windows.shape[0]))
    want_h = any(o.needs_hessian for o in options)
    methods = {o.method for o in options}
    want_norms = "wanda" in methods
    ftw = st.first_token_weight if "gptq" in methods and "sparsegpt" not in methods else 1.0  # one Hessian for both
    if not (want_h or want_norms):  # no statistics: only the measured windows need to run
        windows = windows[:kw]
    tail, states = _reference(model, windows[:kw], device, arch)
    gen = torch.Generator(device="cpu").manual_seed(st.seed)
    rows: list[dict[str, Any]] = []
    gains: list[float] = []
    with progress.task(f"sensitivity ({measure})", total=len(units) * len(options)) as bar:
        run = _Measuring(options, states, tail, measure, arch, bar, st.act_order)

        def measure_layer(job: LayerJob) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            """Layer i's statistics from every window through the original model (its outputs: the next
            layer's inputs), then every unit of the layer under every option, from the cached states."""
            i, layer = job.index, job.layer
            mine = [u for u in units if u.layer == i]
            if want_h or want_norms:
                stats, job.output_batches = _statistics(layer, job.inputs, device, arch, mine, want_h, want_norms, ftw)
            else:
                stats = {n: (None, None) for u in mine for n in u.linears}
            target = states[i + 1]
            delta = torch.randn(target.shape, generator=gen).to(target) * st.noise * target.pow(2).mean().sqrt()
            gain = tail.kl(target + delta, i + 1) / float(delta.pow(2).sum(-1).mean())
            gains.append(gain)
            rows.extend(_measure_unit(run, u, layer, stats, gain) for u in mine)
            return {}, {}

        # the engine's walk: statistics need every window layer by layer (none: the layers are only visited)
        walk = WalkOptions(device=device, description="sensitivity layers")
        run_layerwise(model, windows if (want_h or want_norms) else None, measure_layer, walk)
    return _table(st, options, windows, kw, ftw, gains, rows)


def _table(st: SensitivitySettings, options: list[Option], windows: torch.Tensor, kw: int, ftw: float,
           gains: list[float], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """sensitivity.json's content from the measured rows."""
    result = {"measure": st.measure, "options": [o.label for o in options], "fuse": st.fuse,
              "drift_unit": "KL(original || modified) at the model output, nats per token",
              "kl_windows": kw, "calibration_windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
              "noise": st.noise, "gptq_act_order": st.act_order, "first_token_weight": ftw,
              "propagation_gain": gains, "units": rows}
    if st.measure == "both":
        result["rank_correlation"] = _correlations(rows, options)
    return result


def _reference(model: nn.Module, windows: torch.Tensor, device: torch.device, arch: Arch
               ) -> tuple[_Tail, list[torch.Tensor]]:
    """The original model on the measured windows: each layer's input states (kw, T, d), and the tail that
    runs layers l.. and the head, holding the output every unit's KL is taken against."""
    model.to(device)
    first = capture_inputs(model, windows, device)  # the measured windows, as the walk captures them
    tail = _Tail(model, arch, first.layer_kwargs)
    states = [torch.cat([h.to(device) for h in first.hidden])]
    for i, layer in enumerate(get_module(model, arch.layers)):
        states.append(layer_output(layer, states[-1], first.layer_kwargs[i]))
    tail.set_reference(states[-1], len(states) - 1)
    return tail, states


def _statistics(layer: nn.Module, inputs: Any, device: torch.device, arch: Arch, units: list[Unit],
                want_h: bool, want_norms: bool, first_token_weight: float = 1.0) -> tuple[dict[str, tuple], list[torch.Tensor]]:
    """Per linear of the layer: (Hessian, input norms) from the original inputs over every window; and
    the layer's outputs (the next layer's inputs), from the same pass."""
    names = {n for u in units for n in u.linears}
    groups = present_groups(arch, lambda n: n in names)
    accs = {g[0]: (HessianAccumulator(get_module(layer, g[0]).in_features, device, first_token_weight) if want_h else None,
                   InputNorms(get_module(layer, g[0]).in_features, device) if want_norms else None) for g in groups}

    def observer(*stats: Any) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def fn(x: torch.Tensor, y: torch.Tensor) -> None:
            for acc in stats:
                if acc is not None:
                    acc.add_batch(x)
        return fn

    outputs = forward_layer(layer, inputs, device, {get_module(layer, g[0]): observer(*accs[g[0]]) for g in groups})
    out = {}
    for g in groups:
        h_acc, n_acc = accs[g[0]]
        value = (h_acc.H if h_acc is not None else None, n_acc.norms() if n_acc is not None else None)
        out.update({n: value for n in g})
    return out, outputs


def _measure_unit(run: _Measuring, u: Unit, layer: nn.Module, stats: dict, gain: float) -> dict[str, Any]:
    """Unit u's row: each option applied to its linears in turn, the layer's output error, the drift."""
    options, states, tail, measure, arch = run.options, run.states, run.tail, run.measure, run.arch
    modules = [get_module(layer, n) for n in u.linears]
    originals = [m.weight.data for m in modules]
    params = sum(w.numel() for w in originals)
    row: dict[str, Any] = {"name": f"{arch.layers}.{u.layer}." + "+".join(u.linears), "layer": u.layer,
                           "modules": [f"{arch.layers}.{u.layer}.{n}" for n in u.linears], "params": params,
                           "kl": [], "proxy": [], "layer_error": [], "bits_per_weight": [], "kept": []}
    target = states[u.layer + 1]
    for o in options:
        if not all(o.applies(w.shape[1]) for w in originals):  # a GGUF block that does not divide the inputs
            _not_applicable(row, o, originals, params)
            run.bar.advance(1)
            continue
        for n, m, w in zip(u.linears, modules, originals):
            m.weight.data = apply_option(w, o, *stats[n], act_order=run.act_order).to(w.dtype)
        try:
            y = layer_output(layer, states[u.layer], tail.layer_kwargs[u.layer])
            err = float((y - target).pow(2).sum(-1).mean())
            row["layer_error"].append(err)
            row["proxy"].append(gain * err)
            row["kl"].append(tail.kl(y, u.layer + 1) if measure != "proxy" else None)
        finally:
            for m, w in zip(modules, originals):
                m.weight.data = w
        row["bits_per_weight"].append(sum(o.bits_per_weight(w.shape[1]) * w.numel() for w in originals) / params
                                      if o.quantizes else None)
        row["kept"].append(o.kept())
        run.bar.advance(1)
    row["drift"] = row["proxy"] if measure == "proxy" else row["kl"]
    return row


def _not_applicable(row: dict[str, Any], o: Any, originals: list[torch.Tensor], params: int) -> None:
    """Option `o` cannot hold the unit: NaN drift (the allocation never picks it), its nominal cost."""
    for key in ("layer_error", "proxy", "kl"):
        row[key].append(math.nan)
    row["bits_per_weight"].append(sum(o.bits_per_weight(w.shape[1]) * w.numel() for w in originals) / params)
    row["kept"].append(o.kept())


def _correlations(rows: list[dict], options: list[Option]) -> dict[str, float]:
    kl = [v for r in rows for v in r["kl"]]
    proxy = [v for r in rows for v in r["proxy"]]
    out = {"all": spearman(kl, proxy)}
    for j, o in enumerate(options):
        out[o.label] = spearman([r["kl"][j] for r in rows], [r["proxy"][j] for r in rows])
    return {k: (round(v, 4) if math.isfinite(v) else None) for k, v in out.items()}
