"""What an int8-activation prefill could buy (issue #39's TTFT bar, not built): at the demo's linear shapes,
a prompt's rows through a bf16 GEMM (what the bf16 model does) against int8 x int8 -> int32 GEMMs (`torch._int_mm`,
AVX-512 VNNI here) including the per-row quantization of the activations and the rescaling of the result.
No exactness claimed: int8 activations change the numbers, which is why it is only measured.

    python benchmarks/studies/serving/int8_prefill_gemm.py --rows 128,512 --repeats 50

One process, the two ways interleaved per shape, medians; run it with the machine quiet.
Writes benchmarks/results/int8_prefill_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS, time_us  # noqa: E402

# the demo's (SmolLM2-135M) decoder linears: (in, out, count per layer)
SHAPES = [(576, 576, 2), (576, 192, 2), (576, 1536, 2), (1536, 576, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,512")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    out = {"threads": a.threads, "rows": {}}
    print(f"{'rows':>5} {'in x out':>11} {'bf16 us':>9} {'int8 us':>9} {'ratio':>6}")
    for rows in [int(r) for r in a.rows.split(",")]:
        per_layer = {"bf16": 0.0, "int8": 0.0}
        shapes = []
        for k, n, count in SHAPES:
            x = torch.randn(rows, k, generator=g).bfloat16()
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            w_scale = w.float().abs().amax(1) / 127  # (n,)
            wq_t = torch.round(w.float() / w_scale[:, None]).to(torch.int8).t()  # (k, n), column-major view

            def int8_path() -> torch.Tensor:
                xf = x.float()
                s = xf.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
                xq = torch.round(xf / s).to(torch.int8)
                return (torch._int_mm(xq, wq_t).float() * s * w_scale).bfloat16()

            def bf16_path() -> torch.Tensor:
                return torch.nn.functional.linear(x, w)

            tb, ti = time_us(bf16_path, a.repeats)["median_us"], time_us(int8_path, a.repeats)["median_us"]
            per_layer["bf16"] += count * tb
            per_layer["int8"] += count * ti
            shapes.append({"in": k, "out": n, "per_layer": count, "bf16_us": round(tb, 1), "int8_us": round(ti, 1)})
            print(f"{rows:>5} {f'{k}x{n}':>11} {tb:>9.1f} {ti:>9.1f} {ti / tb:>6.2f}")
        ratio = per_layer["int8"] / per_layer["bf16"]
        print(f"{rows:>5} {'a layer':>11} {per_layer['bf16']:>9.1f} {per_layer['int8']:>9.1f} {ratio:>6.2f}")
        out["rows"][rows] = {"shapes": shapes, "layer_bf16_us": round(per_layer["bf16"], 1),
                             "layer_int8_us": round(per_layer["int8"], 1), "ratio": round(ratio, 3)}
    path = RESULTS / "int8_prefill_gemm.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
