"""Screen GPTQ solver variants cheaply: every decoder linear of the demo model solved on cached Hessians.

The per-layer statistics of benchmarks/studies/gptq/gptq_layer_check.py (H of the *unquantized* model's inputs on the
calibration windows, one pass, and the position-0 inputs), computed once and cached; then each variant (a
JSON object of `gptq_quantize` keyword arguments, or {"rtn": ...} for round-to-nearest) solves all 120
groups of linears, and its error per linear is compared with the first variant's:

- `obj`: the objective the solver gets, tr(ΔW H_w ΔWᵀ) / tr(W H_w Wᵀ) with H_w the Hessian with first
  tokens weighted 16x (the stage's default);
- `all`: the same with every token alike; `sink`: at position 0 only.

Reported per variant: the geometric mean over the 210 linears of each error's ratio to the first variant's,
and how many linears got worse than RTN. A screen, not a result: the true-sequential pipeline and the
perplexity decide (gptq_bench.py).

  python benchmarks/studies/gptq/gptq_screen.py --variants '[{"act_order": "group"}, {"act_order": "static"}]'
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import calibration_ids  # noqa: E402
from studies.gptq.gptq_layer_check import collect  # noqa: E402


def load_stats(cache: Path, samples: int):
    from geminicompress.core.arch import decoder_layers, get_module
    from geminicompress.models.loading import demo_dir, load_model

    loaded = load_model(str(demo_dir()))
    model = loaded.model.float().eval()
    if cache.exists():
        stats = torch.load(cache)
    else:
        stats = collect(model, calibration_ids(loaded.tokenizer, samples))
        torch.save(stats, cache)
    layers = decoder_layers(model)
    weights = {k: [get_module(layers[k[0]], n).weight.detach().float().clone() for n in k[1]] for k in stats}
    return stats, weights


def solve(variant: dict, W: torch.Tensor, Hw: torch.Tensor, spec) -> torch.Tensor:
    from geminicompress.compress.gptq.solver import gptq_quantize
    from geminicompress.compress.scale_search import clip_qparams
    from geminicompress.core.grid import qparams, quantize

    v = dict(variant)
    refit = v.pop("refit", 0)
    if "rtn" in v:  # round-to-nearest with the given grid / clip search (no Hessian but for importance)
        opts = v["rtn"]
        gs = W.shape[1] if spec.group_size == -1 else spec.group_size
        out = torch.empty_like(W)
        for g in range(0, W.shape[1], gs):
            w = W[:, g:g + gs]
            if opts.get("clip"):
                c = opts["clip"]
                imp = torch.diag(Hw)[g:g + gs] if c.get("importance") == "hdiag" else None
                s, z = clip_qparams(w, spec, imp, grid=c.get("grid", 20), maxshrink=c.get("maxshrink", 0.2),
                                    norm=c.get("norm", 2.0), sym_range=opts.get("sym_range", "full"))
            else:
                s, z = qparams(w, spec, sym_range=opts.get("sym_range", "full"))
            out[:, g:g + gs] = s * (quantize(w, s, z, spec.maxq) - z)
        return out
    qw, _ = gptq_quantize(W, Hw, spec, **v)
    if refit:
        from studies.gptq.refit import refit_scales
        for _ in range(refit):
            qw = refit_scales(qw, W, Hw)
    return qw.dequantize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True, help="JSON list of gptq_quantize kwargs; the first is the reference")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--first-token-weight", type=float, default=16.0)
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    ap.add_argument("--cache", default="/tmp/gptq_screen_stats.pt")
    ap.add_argument("--out", default=None, help="results file (default: none)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from geminicompress.core.grid import QuantSpec

    spec = QuantSpec(args.bits, args.group_size, True)
    variants = json.loads(args.variants)
    stats, weights = load_stats(Path(args.cache), args.samples)
    keep = None if args.layers is None else {int(i) for i in args.layers.split(",")}
    errs: list[list[dict]] = [[] for _ in variants]
    rtn = {"rtn": {"sym_range": "absmax"}}
    rtn_errs: list[dict] = []
    seconds = [0.0] * len(variants)
    for (i, group), s in stats.items():
        if keep is not None and i not in keep:
            continue
        H, x0 = s["H"], s["x0"]
        Hw = H + (args.first_token_weight - 1.0) * 2.0 / s["tokens"] * x0.T @ x0
        W = torch.cat(weights[(i, group)])
        sizes = [w.shape[0] for w in weights[(i, group)]]

        def measure(Wq: torch.Tensor) -> list[dict]:
            rows, start = [], 0
            for name, n in zip(group, sizes):
                w, d = W[start:start + n], Wq[start:start + n] - W[start:start + n]
                start += n
                rows.append({"name": f"{i}.{name}",
                             "obj": float(((d @ Hw) * d).sum() / ((w @ Hw) * w).sum()),
                             "all": float(((d @ H) * d).sum() / ((w @ H) * w).sum()),
                             "sink": float((x0 @ d.T).square().sum() / (x0 @ w.T).square().sum())})
            return rows

        rtn_errs += measure(solve(rtn, W, Hw, spec))
        for k, v in enumerate(variants):
            t0 = time.perf_counter()
            Wq = solve(v, W, Hw, spec)
            seconds[k] += time.perf_counter() - t0
            errs[k] += measure(Wq)
    summary = []
    for k, v in enumerate(variants):
        row = {"variant": v, "seconds": round(seconds[k], 1)}
        for m in ("obj", "all", "sink"):
            row[f"{m}_vs_first"] = round(math.exp(sum(math.log(a[m] / b[m]) for a, b in zip(errs[k], errs[0])) / len(errs[0])), 4)
            row[f"{m}_vs_rtn"] = round(math.exp(sum(math.log(a[m] / b[m]) for a, b in zip(errs[k], rtn_errs)) / len(rtn_errs)), 4)
        row["worse_than_rtn"] = sum(a["all"] > b["all"] for a, b in zip(errs[k], rtn_errs))
        ratios = [(a["all"] / b["all"], a["name"]) for a, b in zip(errs[k], errs[0])]
        row["max_all_vs_first"] = [round(max(ratios)[0], 3), max(ratios)[1]]
        row["min_all_vs_first"] = [round(min(ratios)[0], 3), min(ratios)[1]]
        summary.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"spec": vars(args), "summary": summary, "rtn": rtn_errs,
                                              "linears": errs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
