"""Bar: the sensitivity pass on the demo model takes at most 3x one GPTQ run with the same calibration windows.

Both in one process, on the same ids (benchmarks/common.calibration_ids: 32 windows of 512 tokens from
../shared/data/enwiki-sample.txt, seed 0), each on a freshly loaded model (loading not timed):
- one GPTQ run: the real gptq stage at 4-bit g64 with its defaults (act-order, first-token weight 16),
  fake-quantized in memory, no export;
- the sensitivity pass the allocation needs: `measure_sensitivity` with gptq:b4g64,gptq:b3g64, the proxy
  measure (what `quantize --target-bits` and `tune` run when no table is given).
`--repeats N` alternates them N times and reports the median of each. Timings are only meaningful on a
quiet machine:

  PYTHONPATH=$PWD python benchmarks/studies/allocation/allocation_timing.py --repeats 1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from reproduce.allocation_bench import quant_row  # noqa: E402
from common import RESULTS, calibration_ids  # noqa: E402
from geminicompress.compress.sensitivity.measure import SensitivitySettings


def time_gptq(demo: Path, calib: torch.Tensor, work: Path) -> float:
    return quant_row(demo, calib, {"bits": 4, "group_size": 64}, work, None)[1]["stage_seconds"]


def time_sensitivity(demo: Path, calib: torch.Tensor, options: str) -> float:
    from geminicompress.compress.sensitivity.measure import measure_sensitivity
    from geminicompress.compress.sensitivity.options import parse_options
    from geminicompress.compress.targets import decoder_linears
    from geminicompress.core.arch import arch_for
    from geminicompress.models.loading import load_model

    model = load_model(str(demo)).model
    keep = set(decoder_linears(model, arch_for(model), []))
    t0 = time.perf_counter()
    measure_sensitivity(model, calib, parse_options(options), SensitivitySettings(keep=keep, measure="proxy",
                                                                                  kl_windows=2, seed=0))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--options", default="gptq:b4g64,gptq:b3g64")
    ap.add_argument("--name", default="allocation_timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    demo = demo_dir()
    calib = calibration_ids(load_model(str(demo)).tokenizer, args.windows, seed=0)
    work = Path(tempfile.mkdtemp(prefix="alloc-timing-"))
    gptq, sens = [], []
    for r in range(args.repeats):
        gptq.append(time_gptq(demo, calib, work / "out"))
        sens.append(time_sensitivity(demo, calib, args.options))
        print(f"repeat {r}: gptq {gptq[-1]:.1f} s, sensitivity {sens[-1]:.1f} s", flush=True)
    g, s = statistics.median(gptq), statistics.median(sens)
    result = {"protocol": {"calibration_windows": args.windows, "seq_len": 512, "calibration_seed": 0,
                           "gptq": "b4g64, stage defaults", "sensitivity_options": args.options, "measure": "proxy"},
              "gptq_seconds": gptq, "sensitivity_seconds": sens, "gptq_median_s": round(g, 2),
              "sensitivity_median_s": round(s, 2), "ratio": round(s / g, 3), "bar": "ratio <= 3",
              "machine": machine(), "versions": versions()}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"sensitivity / gptq = {s:.1f} / {g:.1f} s = {s / g:.2f}x (bar: <= 3x)")


if __name__ == "__main__":
    main()
