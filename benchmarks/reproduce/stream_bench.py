"""Streaming bars (issue 15): peak resident memory of streamed runs on models bigger than RAM, output
sparsity counted from the written files, and whether the output loads in transformers.

Makes nothing itself: give it a synthetic checkpoint (../shared/tools/synth_model.py) and the runs to do.
On a GPU machine, the issue's GPU check (peak GPU memory and time per layer of the 8B-shaped GPTQ):

  python benchmarks/reproduce/stream_bench.py --model SYNTH_8B --work /tmp/sb --name gptq_cuda \
      --run "gptq_cuda:--method gptq --bits 4 --group-size 128 --samples 32 --calib-seq-len 512 --device cuda --data TEXT"

  python benchmarks/reproduce/stream_bench.py --model /work/synth8b --work /work/scratch \\
      --run prune:"--sparsity 0.4" --run int8:"--method int8" [--load-check SMALL_OUT_DIR]

Each run is `geminicompress {prune|quantize} MODEL -o WORK/NAME --stream ARGS` under /usr/bin/time -v
(peak RSS = "Maximum resident set size"). For prune runs, the sparsity of the decoder linears is counted
from OUT's safetensors one tensor at a time. Wall times are recorded but on a shared machine they are not
benchmark figures. Prints a table and writes benchmarks/results/stream_bench[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def peak_rss_run(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """(exit code, wall seconds, peak RSS bytes) of `cmd` under /usr/bin/time -v."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())
    return rc, wall, int(m.group(1)) * 1024 if m else -1


def sparsity_from_files(out: Path) -> dict:
    """Zeros / params over the decoder linears' weights, read tensor by tensor from OUT's shards."""
    import torch
    from safetensors import safe_open

    zeros = params = 0
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if ".layers." in name and name.endswith("proj.weight"):
                    t = f.get_tensor(name)
                    zeros += int((t == 0).sum())
                    params += t.numel()
                    del t
    return {"zeros": zeros, "params": params, "sparsity": zeros / max(1, params), "dtype": str(torch.bfloat16)}


def load_check(out: Path) -> dict:
    """Load OUT with transformers (+ our int8 loader for compressed-tensors) and run one forward."""
    import torch

    from geminicompress.models.loading import load_model

    loaded = load_model(str(out), dtype=torch.bfloat16)
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = loaded.model(ids).logits
    return {"loaded": True, "format": loaded.format, "finite_logits": bool(torch.isfinite(logits).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--run", action="append", default=[], help="NAME:ARGS, e.g. prune:'--sparsity 0.4' or int8:'--method int8'")
    ap.add_argument("--load-check", action="append", default=[], type=Path, help="an output folder to load in transformers")
    ap.add_argument("--name", default="")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (default: delete them after measuring)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in a.run:
        name, _, args = spec.partition(":")
        command = "prune" if name.startswith("prune") else "quantize"
        out = a.work / name
        cmd = [sys.executable, "-m", "geminicompress", command, a.model, "-o", str(out), "--stream", "--force", "-q",
               *shlex.split(args)]
        rc, wall, rss = peak_rss_run(cmd, a.work / f"{name}.log")
        row = {"name": name, "command": " ".join(cmd[1:]), "exit": rc, "peak_rss_gib": round(rss / 2**30, 3),
               "wall_s_shared_machine": round(wall, 1)}
        if rc == 0:
            report = json.loads((out / "report.json").read_text())
            row["output_bytes"] = report["export"]["total_bytes"]
            row["estimated_peak_gib"] = round(report["export"]["estimated"]["peak_memory_bytes"] / 2**30, 3)
            row["device"] = report["export"].get("device", "cpu")
            if "gpu_peak_bytes" in report["export"]:
                row["gpu_peak_gib"] = round(report["export"]["gpu_peak_bytes"] / 2**30, 3)
            seconds = [x["layer_seconds"] for st in report["stages"][:1] for x in st["result"].get("layers", [])
                       if isinstance(x, dict) and "layer_seconds" in x]
            if seconds:
                import statistics

                row["layer_seconds_median"] = round(statistics.median(seconds), 2)
            if command == "prune":
                row.update(sparsity_from_files(out))
            if not a.keep:
                import shutil

                shutil.rmtree(out)
        rows.append(row)
        print(json.dumps(row), flush=True)
    checks = [{"path": str(p), **load_check(p)} for p in a.load_check]
    result = {"model": a.model, "runs": rows, "load_checks": checks}
    from geminicompress.host.machine import machine, versions

    result.update({"machine": machine(), "versions": versions(),
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=ROOT).stdout.strip()})
    dest = ROOT / "benchmarks" / "results" / f"stream_bench{'_' + a.name if a.name else ''}.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'run':<12} {'exit':>4} {'peak RSS GiB':>12} {'est. GiB':>8} {'sparsity':>9} {'GPU GiB':>8} {'s/layer':>8}")
    for r in rows:
        sp = f"{r['sparsity']:.4%}" if "sparsity" in r else "-"
        print(f"{r['name']:<12} {r['exit']:>4} {r['peak_rss_gib']:>12} {r.get('estimated_peak_gib', '-'):>8} {sp:>9} "
              f"{r.get('gpu_peak_gib', '-'):>8} {r.get('layer_seconds_median', '-'):>8}")
    for c in checks:
        print(f"load check {c['path']}: {c}")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
