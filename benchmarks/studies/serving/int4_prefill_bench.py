"""Per-linear time of the int4 ways to run prefill on a CPU (issue #39): rows M of activations through one
linear of the demo's shapes, 4-bit g64 codes, bf16 activations.

- kernel: torch's int4 kernel (`_weight_int4pack_mm_for_cpu`), what decode runs on;
- dequant+gemm: the bf16 weight rebuilt once per call from the packed codes (`dequantize_packed`, what
  `Int4Linear` does from PREFILL_ROWS rows on), then a bf16 GEMM;
- cached bf16: a bf16 GEMM on a dequantized weight kept beside the codes (+2 bytes per weight);
- dense bf16 / fp32: the dense linear the quantized one stands for.

Medians (and p10-p90) of `--repeats` timed calls after warm-up, per (shape, M). Run with the machine quiet:
on a shared machine the figures say little (the JSON records the load average).

    python benchmarks/studies/serving/int4_prefill_bench.py --threads 2 --out benchmarks/results/int4_prefill_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import time_us  # noqa: E402

from geminicompress.kernels.int4 import CODE_OFFSET, cpu_block, dequantize_packed, int4_mm, pack_for  # noqa: E402

SHAPES = {"q_proj/o_proj": (576, 576), "gate/up": (1536, 576), "down": (576, 1536)}  # (out, in)
ROWS = (1, 8, 32, 64, 96, 128, 256, 512)
GROUP = 64


def dequant(codes_u8: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """(out, in) bf16 from uint8 codes (out, in) and scales_and_zeros (K, out, 2): S·(q − 8) + Z."""
    out_f, in_f = codes_u8.shape
    q = codes_u8.view(out_f, in_f // group, group).to(torch.bfloat16) - CODE_OFFSET  # (out, K, g)
    s, z = sz[..., 0].t().unsqueeze(-1), sz[..., 1].t().unsqueeze(-1)  # (out, K, 1)
    return (q * s + z).view(out_f, in_f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for label, (out_f, in_f) in SHAPES.items():
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
        sz = torch.stack([torch.rand(in_f // GROUP, out_f) * 0.01 + 1e-3,
                          torch.randn(in_f // GROUP, out_f) * 0.01], -1).to(torch.bfloat16)
        packed, u8 = pack_for(codes, torch.device("cpu")), codes.to(torch.uint8)
        block = cpu_block(packed, codes)
        offsets = (sz[..., 1].float() - CODE_OFFSET * sz[..., 0].float()).to(torch.bfloat16)
        w_bf16 = dequant(u8, sz, GROUP)
        w_fp32 = w_bf16.float()
        for m in ROWS:
            x = torch.randn(m, in_f, dtype=torch.bfloat16)
            xf = x.float()
            row = {"shape": label, "out": out_f, "in": in_f, "rows": m,
                   "kernel": time_us(lambda: int4_mm(x, packed, GROUP, sz), args.repeats),
                   "dequant+gemm": time_us(lambda: x @ dequantize_packed(packed, block, GROUP, offsets, sz[..., 0],
                                                                      out_f, in_f), args.repeats),
                   "cached bf16": time_us(lambda: x @ w_bf16.t(), args.repeats),
                   "dense fp32": time_us(lambda: xf @ w_fp32.t(), args.repeats)}
            rows.append(row)
            print(label, m, {k: v["median_us"] for k, v in row.items() if isinstance(v, dict)}, flush=True)
    result = {"threads": args.threads, "load_average": os.getloadavg(), "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "group": GROUP, "rows": rows,
              "note": "timed on a shared machine: medians only indicative"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
