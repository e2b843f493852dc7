"""Round-to-nearest on the demo model with each symmetric grid and with the clipping search: perplexity.

Grids (zero point fixed at 2^(b−1), scale free per group: what the gptq and compressed-tensors formats store):
- `absmax`: scale 2·max|w| / (2^b − 1), GPTQ's and compressed-tensors' (the largest positive weight is
  clipped when it is the row's largest magnitude);
- `absmax/7`: scale max|w| / (2^(b−1) − 1), the issue's reference grid (never clips, wastes code 0);
- `full`: the smallest scale that clips neither end (grid.qparams' default);
- `full+clip`: `full`, then the clipping search of compress/scale_search.py (shrink by up to `maxshrink`
  on a grid of 20; error |w − q|^p, every column alike: RTN has no calibration data).
Protocol: the project's (benchmarks/common.py); no calibration.

  python benchmarks/studies/gptq/rtn_grid_bench.py --settings w4-pc,w4-g64,w3-g64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import RESULTS, eval_windows, perplexity  # noqa: E402

SETTINGS = {"w4-pc": (4, -1), "w4-g64": (4, 64), "w3-g64": (3, 64)}
GRIDS = {
    "absmax": {"sym_range": "absmax"},
    "absmax/7": {"sym_range": "absmax7"},
    "full": {"sym_range": "full"},
    "full+clip p2": {"sym_range": "full", "clip": {"grid": 20, "maxshrink": 0.2, "norm": 2.0}},
    "full+clip p2.4": {"sym_range": "full", "clip": {"grid": 20, "maxshrink": 0.2, "norm": 2.4}},
    "full+clip p3": {"sym_range": "full", "clip": {"grid": 20, "maxshrink": 0.2, "norm": 3.0}},
}


def fake_quantize_weight(w: torch.Tensor, bits: int, group: int, grid: dict) -> torch.Tensor:
    from geminicompress.compress.scale_search import clip_qparams
    from geminicompress.core.grid import QuantSpec, qparams, quantize

    spec = QuantSpec(bits, group, True)
    width = w.shape[1] if group == -1 else group
    rows = w.float().reshape(-1, width)  # (out · groups, width): every group is a row of its own
    if grid["sym_range"] == "absmax7":
        half = (spec.maxq + 1) // 2
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / (half - 1)
        zero = torch.full_like(scale, half)
    elif "clip" in grid:
        c = grid["clip"]
        scale, zero = clip_qparams(rows, spec, None, grid=c["grid"], maxshrink=c["maxshrink"], norm=c["norm"],
                                   sym_range=grid["sym_range"])
    else:
        scale, zero = qparams(rows, spec, sym_range=grid["sym_range"])
    scale = scale.half().float()  # what the checkpoint stores
    return (scale * (quantize(rows, scale, zero, spec.maxq) - zero)).reshape(w.shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="w4-pc,w4-g64,w3-g64")
    ap.add_argument("--grids", default=",".join(GRIDS))
    ap.add_argument("--name", default="rtn_grid_bench")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from geminicompress.core.arch import arch_for, decoder_layers, get_module
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    demo = demo_dir()
    base = load_model(str(demo))
    eval_ids = eval_windows(base.tokenizer)
    names = arch_for(base.model).linears
    original = {(i, n): get_module(layer, n).weight.detach().clone()
                for i, layer in enumerate(decoder_layers(base.model)) for n in names}
    path = RESULTS / f"{args.name}.json"
    meta = {"benchmark": "rtn grids", "command": "python " + " ".join(sys.argv),
            "perplexity": f"wikitext2-test.txt, first {eval_ids.numel()} tokens, {len(eval_ids)} x 512",
            "machine": machine(), "versions": versions()}
    rows = []
    for setting in args.settings.split(","):
        bits, group = SETTINGS[setting]
        for label in args.grids.split(","):
            with torch.no_grad():
                for i, layer in enumerate(decoder_layers(base.model)):
                    for n in names:
                        w = original[(i, n)]
                        get_module(layer, n).weight.copy_(fake_quantize_weight(w, bits, group, GRIDS[label]))
            rows.append({"setting": setting, "grid": label, "options": GRIDS[label],
                         "ppl": round(perplexity(base.model, eval_ids), 3)})
            print(json.dumps(rows[-1]), flush=True)
            path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
