"""Per-layer check of the GPTQ solver against round-to-nearest on every decoder linear of the demo model.

For each group of linears that read the same input (q/k/v, o, gate/up, down) of every decoder layer, the
Hessian H = 2/N · Σ xᵀx of the *unquantized* model's inputs on the calibration windows (one forward pass
with hooks: the solver's check, not the true-sequential pipeline; the solver gets H with the first tokens
weighted as the stage weights them), then per linear (rows of the stacked
solve) the relative output error on those inputs

    ‖X(Ŵ − W)ᵀ‖² / ‖XWᵀ‖² = tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)

of GPTQ with the flags `quantize --method gptq` uses by default (GPTQStage's defaults) against RTN on
the same grid (grid.rtn_quantize: the same qparams). Bar: GPTQ ≤ RTN for every linear.

It also reports the same ratio at the attention-sink token (position 0 of every window) for v_proj,
‖x₀ΔWᵀ‖² / ‖x₀Wᵀ‖²: that token is 1 of 512 in H, but every later query attends to it heavily, so an
error in its value vector reaches every position. This is what made GPTQ without act-order lose to RTN in
perplexity on the demo (docs/gptq.md, "Defaults, and why"), while its output error above was lower everywhere.

  python benchmarks/studies/gptq/gptq_layer_check.py                     # 32 windows, 4-bit g64, the defaults
  python benchmarks/studies/gptq/gptq_layer_check.py --bits 3 --flags '{"act_order": false}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import RESULTS, calibration_ids  # noqa: E402


@torch.no_grad()
def collect(model, ids: torch.Tensor, batch: int = 4) -> dict[tuple[int, tuple[str, ...]], dict]:
    """{(layer, group): {"H": (in, in), "x0": (windows, in) position-0 inputs}} from one pass of the model."""
    from geminicompress.compress.hessian import HessianAccumulator
    from geminicompress.core.arch import arch_for, decoder_layers, get_module

    arch = arch_for(model)
    stats, handles = {}, []
    for i, layer in enumerate(decoder_layers(model)):
        for group in arch.sequential:
            first = get_module(layer, group[0])
            entry = stats[(i, group)] = {"acc": HessianAccumulator(first.in_features), "x0": []}

            def hook(module, args, output, entry=entry):
                x = args[0].detach().float()  # (b, T, in)
                entry["acc"].add_batch(x)
                entry["x0"].append(x[:, 0])

            handles.append(first.register_forward_hook(hook))
    try:
        for b in range(0, len(ids), batch):
            model(ids[b:b + batch])
    finally:
        for h in handles:
            h.remove()
    return {k: {"H": v["acc"].H.clone(), "x0": torch.cat(v["x0"]), "tokens": v["acc"].tokens} for k, v in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--flags", default="{}", help="JSON of GPTQStage fields over its defaults, e.g. '{\"act_order\": false}'")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/gptq_layer_check[_b3...].json)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from geminicompress.compress.gptq.config import GPTQStage
    from geminicompress.compress.gptq.solver import gptq_quantize
    from geminicompress.core.arch import decoder_layers, get_module
    from geminicompress.core.grid import QuantSpec, rtn_quantize
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    cfg = GPTQStage(method="gptq", bits=args.bits, group_size=args.group_size, **json.loads(args.flags))
    spec = QuantSpec(cfg.bits, cfg.group_size, cfg.sym)
    loaded = load_model(str(demo_dir()))
    model = loaded.model.float().eval()
    t0 = time.perf_counter()
    stats = collect(model, calibration_ids(loaded.tokenizer, args.samples))
    layers = decoder_layers(model)
    rows, worse = [], []
    for (i, group), s in stats.items():
        H, x0 = s["H"], s["x0"]  # errors are measured with the plain H, every token alike
        W = torch.cat([get_module(layers[i], n).weight.detach().float() for n in group])  # (Σ out, in)
        # the solver gets the Hessian the stage builds: first tokens counted first_token_weight times
        Hw = H + (cfg.first_token_weight - 1.0) * 2.0 / s["tokens"] * x0.T @ x0
        qw, _ = gptq_quantize(W, Hw, spec, damp=cfg.damp, block_size=cfg.block_size, act_order=cfg.act_order)
        dg, dr = qw.dequantize() - W, rtn_quantize(W, spec).dequantize() - W
        start = 0
        for name in group:
            rs = slice(start, start + get_module(layers[i], name).out_features)
            start = rs.stop
            w = W[rs]
            ref, ref0 = float(((w @ H) * w).sum()), float((x0 @ w.T).square().sum())
            row = {"layer": i, "linear": name,
                   "gptq_rel_output_error": float(((dg[rs] @ H) * dg[rs]).sum()) / ref,
                   "rtn_rel_output_error": float(((dr[rs] @ H) * dr[rs]).sum()) / ref,
                   "gptq_rel_error_pos0": float((x0 @ dg[rs].T).square().sum()) / ref0,
                   "rtn_rel_error_pos0": float((x0 @ dr[rs].T).square().sum()) / ref0}
            rows.append(row)
            if row["gptq_rel_output_error"] > row["rtn_rel_output_error"]:
                worse.append(f"{i}.{name}")
    v = [r for r in rows if r["linear"].endswith("v_proj")]
    result = {
        "check": "gptq vs rtn output error, every decoder linear, unquantized-model inputs",
        "calibration": f"{args.samples} x 512 tokens, enwiki-sample.txt, seed 0",
        "spec": {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym},
        "gptq_flags": {k: getattr(cfg, k) for k in ("act_order", "damp", "first_token_weight", "block_size")},
        "bar_gptq_le_rtn_every_linear": not worse, "linears": len(rows), "gptq_worse": worse,
        "mean_ratio_gptq_over_rtn": sum(r["gptq_rel_output_error"] / r["rtn_rel_output_error"] for r in rows) / len(rows),
        "v_proj_pos0_mean_ratio_gptq_over_rtn": sum(r["gptq_rel_error_pos0"] / r["rtn_rel_error_pos0"] for r in v) / len(v),
        "v_proj_pos0_gptq_worse": sum(r["gptq_rel_error_pos0"] > r["rtn_rel_error_pos0"] for r in v),
        "seconds_shared_machine": round(time.perf_counter() - t0, 1),
        "rows": rows, "machine": machine(), "versions": versions(),
    }
    suffix = "" if (args.bits, args.group_size, args.flags) == (4, 64, "{}") else \
        f"_w{args.bits}g{args.group_size}" + ("" if args.flags == "{}" else "_" + "_".join(f"{k}-{v}" for k, v in json.loads(args.flags).items()))
    path = Path(args.out) if args.out else RESULTS / f"gptq_layer_check{suffix}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "machine", "versions")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
