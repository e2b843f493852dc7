"""Issue #37's decode-speed bar: in llama.cpp, our default GPTQ Q4_0 file decodes within 10% of llama.cpp's own
Q4_0 file (same kernels), and at most 0.5x our torch int4 TPOT.

One script run, one quiet machine, back to back: `geminicompress eval --engine llama.cpp` on [float F32 GGUF,
our Q4_0, llama.cpp's Q4_0 with importance matrix], then `geminicompress eval` (transformers, default kernels:
torch's int4 kernel in bf16) on [demo, our GPTQ output]. Both evals time batch 1 at eval's CPU defaults
(prompt 128, 32 new tokens, 1 warm-up + 3 runs, medians) with the same thread count, and score the same
first 8,192 WikiText-2 tokens in 512-token windows.

    python benchmarks/studies/gguf/gguf_speed.py --ours /work/runs/gguf_f \
        --llama-q4 ~/.cache/geminicompress/gguf-bench/llama-q4_0-imatrix.gguf \
        --float-gguf ~/.cache/geminicompress/gguf-bench/float-f32.gguf \
        --llama-python /work/venv-llama/bin/python

--ours is `quantize smollm2-demo -o OUT --method gptq --format gguf` with default flags (OUT/model.gguf for
llama.cpp, OUT's safetensors for torch). Writes benchmarks/results/gguf_speed.json and the two eval reports
under benchmarks/results/gguf_speed/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import DATA, RESULTS, ROOT  # noqa: E402

OUT = RESULTS / "gguf_speed"


def run_eval(models: list[str], out: Path, *extra: str) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "geminicompress", "eval", *models, "--data", str(DATA / "wikitext2-test.txt"),
           "--max-tokens", "8192", "--seq-len", "512", "-o", str(out), "--force", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return {"command": "geminicompress " + " ".join(cmd[3:]), "report": json.loads((out / "report.json").read_text())}


def row(m: dict) -> dict:
    lat = m.get("latency") or {}
    return {"name": m["name"], "perplexity": (m.get("quality") or {}).get("perplexity"),
            "ttft_ms": (lat.get("ttft_ms") or {}).get("median"), "tpot_ms": (lat.get("tpot_ms") or {}).get("median"),
            "threads": lat.get("threads"), "size_mb": m.get("size_mb"),
            "unreliable": (lat.get("load") or {}).get("unreliable")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="our default `--format gguf` GPTQ output folder")
    ap.add_argument("--llama-q4", required=True, help="llama.cpp's own Q4_0 (importance matrix) GGUF")
    ap.add_argument("--float-gguf", required=True, help="F32 GGUF of the demo (the llama.cpp baseline)")
    ap.add_argument("--llama-python", default=None)
    args = ap.parse_args()
    ours = Path(args.ours)
    extra = ["--llama-python", args.llama_python] if args.llama_python else []
    llama = run_eval([args.float_gguf, str(ours / "model.gguf"), args.llama_q4], OUT / "llama_cpp",
                     "--engine", "llama.cpp", *extra)
    torch = run_eval(["smollm2-demo", str(ours)], OUT / "torch")
    lrows = [row(m) for m in llama["report"]["models"]]
    trows = [row(m) for m in torch["report"]["models"]]
    ours_l, theirs_l = lrows[1], lrows[2]
    ours_t = next(r for r in trows if r["name"] == ours.name or r["name"] == str(ours))
    speed = ours_l["tpot_ms"] / theirs_l["tpot_ms"]
    vs_torch = ours_l["tpot_ms"] / ours_t["tpot_ms"]
    bars = {"ours_vs_llama_q4_0_tpot": round(speed, 4), "within_10pct_met": abs(speed - 1) <= 0.10,
            "ours_llamacpp_vs_torch_int4_tpot": round(vs_torch, 4), "half_of_torch_met": vs_torch <= 0.5}
    print(f"{'engine':<12}{'model':<48}{'ppl':>10}{'TTFT ms':>10}{'TPOT ms':>10}{'threads':>9}")
    for eng, rows in (("llama.cpp", lrows), ("torch", trows)):
        for r in rows:
            ppl = f"{r['perplexity']:.3f}" if r["perplexity"] else "-"
            ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] else "-"
            tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] else "-"
            print(f"{eng:<12}{Path(r['name']).name[:46]:<48}{ppl:>10}{ttft:>10}{tpot:>10}{str(r['threads']):>9}")
    print(f"our Q4_0 / llama.cpp Q4_0 TPOT: {speed:.3f} (bar within 10%: {'met' if bars['within_10pct_met'] else 'NOT met'})")
    print(f"our Q4_0 in llama.cpp / our int4 in torch TPOT: {vs_torch:.3f} (bar <= 0.5: "
          f"{'met' if bars['half_of_torch_met'] else 'NOT met'})")
    path = RESULTS / "gguf_speed.json"
    path.write_text(json.dumps({"benchmark": "gguf_speed", "llama_cpp": llama, "torch": torch, "rows": {
        "llama_cpp": lrows, "torch": trows}, "bars": bars}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
