"""The check of OUT on the way out (geminicompress/engine/verify.py) on the demo model: for each method/format and
output dtype, in memory and streamed, the largest logit difference between OUT loaded back and the
in-process result as stored (what is checked, against 1e-4 of the largest logit), and what rounding the
in-process model to the stored dtype moved (`storage_rounding_diff`, recorded, not checked).

    python benchmarks/studies/stream/verify_bench.py --work SCRATCH [--measure-only] [--only int8,gptq] [--name NAME]

--measure-only lifts the bounds so that every difference is recorded (for choosing the bound); without it a
run that fails the check is recorded with its one-line error. Results: benchmarks/results/verify_bench[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import DATA, RESULTS  # noqa: E402
from geminicompress.runtime.pipeline import RunOptions

RUNS = {  # name -> stage
    "int8": {"type": "quantize", "method": "int8"},
    "w8a8": {"type": "quantize", "method": "w8a8", "smoothquant_alpha": None},
    "w8a8-smoothquant": {"type": "quantize", "method": "w8a8"},
    "rtn-gptq": {"type": "quantize", "method": "rtn", "bits": 4},
    "gptq": {"type": "quantize", "method": "gptq", "bits": 4},
    "gptq-pack-quantized": {"type": "quantize", "method": "gptq", "bits": 4, "format": "compressed-tensors"},
    "awq": {"type": "quantize", "method": "awq", "bits": 4},
    "prune-dense": {"type": "prune", "sparsity": 0.4},
    "prune-2:4-sparse-bitmask": {"type": "prune", "pattern": "2:4", "scope": "layer", "format": "compressed-tensors"},
}


def run_one(name: str, dtype: str, stream: bool, work: Path, samples: int) -> dict:
    import torch

    from geminicompress.core.errors import GeminiError
    from geminicompress.models.loading import local_dir
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage
    from geminicompress.runtime.plan import not_streamable

    recipe = recipe_from_stage("smollm2-demo", RUNS[name], {"data": str(DATA / "enwiki-sample.txt"), "samples": samples,
                                                            "seq_len": 512}, "bench", output={"dtype": dtype})
    why = not_streamable(recipe, local_dir(recipe.model)) if stream else None
    if why:
        return {"run": name, "dtype": dtype, "streamed": stream, "skipped": why}
    out = work / f"{name}-{dtype}-{'s' if stream else 'm'}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        report = run_recipe(recipe, out, RunOptions(device=torch.device("cpu"), stream=stream))
    except GeminiError as exc:
        return {"run": name, "dtype": dtype, "streamed": stream, "error": str(exc)}
    shutil.rmtree(out, ignore_errors=True)
    verified = report["export"]["verified"]
    return {"run": name, "dtype": dtype, "streamed": stream, "format": report["export"]["format"], **verified,
            "relative_diff": verified["max_abs_logit_diff"] / verified["max_abs_logit"],
            "relative_storage_rounding": (verified["storage_rounding_diff"] / verified["max_abs_logit"]
                                          if verified["storage_rounding_diff"] is not None else None),
            "run_seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--measure-only", action="store_true", help="no bound: record every difference")
    parser.add_argument("--only", default=None, help="comma-separated run names")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="memory,stream")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--name", default="")
    args = parser.parse_args()

    from geminicompress.engine import verify

    if args.measure_only:
        verify.TOLERANCE = float("inf")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    names = args.only.split(",") if args.only else list(RUNS)
    for name in names:
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                row = run_one(name, dtype, mode == "stream", args.work, args.samples)
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = RESULTS / f"verify_bench{'_' + args.name if args.name else ''}.json"
    from geminicompress.host.machine import machine, versions

    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "versions": versions(),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
