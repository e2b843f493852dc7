"""Issue #25's kernel bar: one `geminicompress eval` run with default flags on the demo model and its 4-bit
g64 GPTQ and AWQ outputs (the int4 formats run torch's int4 kernel in bf16; eval adds the baseline timed
in bf16): TPOT <= 0.6x the bf16 baseline's at batch 1, and perplexity through the fast path within 0.5%
of the reference path's (a second eval, `--kernels reference --no-latency`, on the same windows).

    python benchmarks/reproduce/int4_eval_bar.py --models-dir /work/serve-models [--part timed|reference|both]

The timed part is the command a user would type (run it alone on the machine: /work/bin/quiet); the
reference part only computes perplexities. Protocol: benchmarks/common.py (wikitext2-test.txt, first
16,384 tokens, 512-token windows); latency at eval's CPU defaults (prompt 128, 32 new tokens, batch 1
and 4, 1 warm-up + 3 runs). Writes benchmarks/results/int4_eval_bar.json and the eval reports under
benchmarks/results/int4_eval_bar/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import DATA, RESULTS, ROOT  # noqa: E402

OUT = RESULTS / "int4_eval_bar"
MODELS = ("gptq-g64-static", "awq-g64")  # the default GPTQ (act-order static) and AWQ outputs


def run_eval(models: list[str], out: Path, *extra: str) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "geminicompress", "eval", "smollm2-demo", *models, "--data",
           str(DATA / "wikitext2-test.txt"), "--max-tokens", "16384", "--seq-len", "512", "-o", str(out), "--force",
           *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return {"command": "geminicompress " + " ".join(cmd[3:]), "report": json.loads((out / "report.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", default="/work/serve-models")
    ap.add_argument("--part", choices=("timed", "reference", "both"), default="both")
    ap.add_argument("--models", default=",".join(MODELS), help="folders under --models-dir")
    args = ap.parse_args()
    names = args.models.split(",")
    models = [str(Path(args.models_dir) / m) for m in names]
    path = RESULTS / "int4_eval_bar.json"
    result = json.loads(path.read_text()) if path.exists() else {"benchmark": "int4_eval_bar"}
    if args.part in ("timed", "both"):
        result["timed"] = run_eval(models, OUT / "default")
    if args.part in ("reference", "both"):
        result["reference"] = run_eval(models, OUT / "reference", "--kernels", "reference", "--no-latency")
    if "timed" in result and "reference" in result:
        result["bars"] = bars(result["timed"]["report"], result["reference"]["report"], names)
        for line in result["bars"]["lines"]:
            print(line)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def bars(timed: dict, reference: dict, names: list[str]) -> dict:
    by = {m["name"]: m for m in timed["models"]}
    ref = {m["name"]: m for m in reference["models"]}
    bf16 = next(m for m in timed["models"] if m.get("dtype_baseline"))
    base_tpot = bf16["latency"]["tpot_ms"]["median"]
    out, lines = {}, []
    for name in names:
        m = by[name]
        tpot = m["latency"]["tpot_ms"]["median"]
        fast, slow = m["quality"]["perplexity"], ref[name]["quality"]["perplexity"]
        out[name] = {"tpot_ms": tpot, "bf16_tpot_ms": base_tpot, "tpot_ratio": round(tpot / base_tpot, 4),
                     "tpot_bar_met": tpot / base_tpot <= 0.6, "ppl_fast": fast, "ppl_reference": slow,
                     "ppl_change": round(fast / slow - 1, 6), "ppl_bar_met": abs(fast / slow - 1) <= 0.005,
                     "kernel": m["kernel"]}
        lines.append(f"{name}: TPOT {tpot:.2f} ms = {tpot / base_tpot:.3f}x bf16's {base_tpot:.2f} (bar <= 0.6: "
                     f"{'met' if out[name]['tpot_bar_met'] else 'NOT met'}); ppl fast {fast:.4f} vs reference "
                     f"{slow:.4f} ({100 * (fast / slow - 1):+.3f}%, bar 0.5%: {'met' if out[name]['ppl_bar_met'] else 'NOT met'})")
    return {"models": out, "lines": lines}


if __name__ == "__main__":
    main()
