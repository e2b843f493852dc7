"""Why a k-token verification or a batch-4 decode step costs far more than a one-token step on this CPU: the
demo's linears (SmolLM2-135M: 30 layers and its 49,152-row head) for a few rows of activations X (rows, in),
through torch's `linear` (X·Wᵀ, what transformers calls: MKL) against the same product taken as (W·Xᵀ)ᵀ and
through oneDNN's inner product (kernels/cpu_dense.py's routes). All read each weight once; they differ in the
routine that runs the shape. bf16 has no oneDNN column (cpu_dense.py leaves bf16 on torch's route).

    python benchmarks/studies/serving/small_rows_gemm.py [--rows 1,2,4,5,8,16,32,64] [--repeats 15]

One process, the ways interleaved per row count, medians of a whole pass over every linear of the model;
run it with the machine quiet. Writes benchmarks/results/small_rows_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS, time_us  # noqa: E402

from geminicompress.kernels.cpu_dense import ONEDNN, few_rows_linear, onednn_linear  # noqa: E402

# the demo's linears: (in, out, count): 30 layers of q, o (576x576), k, v (576x192), gate, up (576x1536),
# down (1536x576), and the head (576 -> 49,152)
SHAPES = [(576, 576, 60), (576, 192, 60), (576, 1536, 60), (1536, 576, 30), (576, 49152, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"threads": a.threads, "shapes": SHAPES, "rows": {}}
    print(f"{'dtype':>9} {'rows':>5} {'linear ms':>10} {'W.Xt ms':>9} {'ratio':>6} {'oneDNN ms':>10} {'ratio':>6}")
    for dtype_name in a.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        weights = [torch.randn(o, i, dtype=dtype) * 0.02 for i, o, n in SHAPES for _ in range(n)]
        for rows in map(int, a.rows.split(",")):
            xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]

            def linear():
                for w, x in zip(weights, xs):
                    torch.nn.functional.linear(x, w)

            def few():
                for w, x in zip(weights, xs):
                    few_rows_linear(x, w, None)

            def onednn():
                for w, x in zip(weights, xs):
                    onednn_linear(x, w, None)

            t_lin, t_few = time_us(linear, a.repeats), time_us(few, a.repeats)
            t_dnn = time_us(onednn, a.repeats) if ONEDNN and dtype == torch.float32 else None
            err = max(float((torch.nn.functional.linear(x, w).float() - few_rows_linear(x, w, None).float())
                            .abs().max()) for w, x in zip(weights[:4], xs[:4]))
            ratio = t_few["median_us"] / t_lin["median_us"]
            dnn = t_dnn["median_us"] / t_lin["median_us"] if t_dnn else None
            out["rows"][f"{dtype_name}/{rows}"] = {"linear": t_lin, "w_xt": t_few, "ratio": round(ratio, 3),
                                                   "onednn": t_dnn, "onednn_ratio": dnn and round(dnn, 3),
                                                   "max_abs_diff": err}
            dnn_ms = f"{t_dnn['median_us'] / 1e3:>10.2f} {dnn:>6.2f}" if t_dnn else f"{'-':>10} {'-':>6}"
            print(f"{dtype_name:>9} {rows:>5} {t_lin['median_us'] / 1e3:>10.2f} {t_few['median_us'] / 1e3:>9.2f} "
                  f"{ratio:>6.2f} {dnn_ms}")
    path = RESULTS / "small_rows_gemm.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
