"""llama.cpp's perplexity of each GGUF file against our torch eval of the same codes (issue #63's bar: within 0.5%).

Reads the scored rows of `benchmarks/reproduce/gguf_gemma_bos.py` (WORK/kl.json: each file and llama.cpp's
perplexity of it) and the windows it scored (WORK/windows.json), loads every file into torch through our GGUF
loader (every tensor dequantized by `gguf.quants`, bit for bit the file's codes) and takes our perplexity on the
same windows (eval/quality/perplexity.py, float32):

  python benchmarks/reproduce/gguf_torch_check.py --work /work/runs/gguf-demo --name gguf_torch_check_demo
Prints one line per file and writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, perplexity  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="gguf_gemma_bos.py's work folder (kl.json, windows.json)")
    ap.add_argument("--rows", default="", help="rows of kl.json to check, comma separated (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    work = Path(args.work)
    scored = json.loads((work / "kl.json").read_text())
    windows = torch.tensor(json.loads((work / "windows.json").read_text())["windows"])
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = []
    for r in scored["rows"]:
        if wanted and r["row"] not in wanted:
            continue
        path = r.get("file") or str(work / "float-f32.gguf")
        model = load_model(path).model.eval()  # float32: every tensor dequantized by gguf.quants
        ours = perplexity(model, windows)
        del model
        gc.collect()
        rel = (r["perplexity"] - ours) / ours
        rows.append({"row": r["row"], "file": path, "llama_cpp_ppl": r["perplexity"], "torch_ppl": round(ours, 4),
                     "rel_diff": round(rel, 6)})
        print(f"{r['row']:28s} llama.cpp {r['perplexity']:9.4f}  torch {ours:9.4f}  {100 * rel:+.3f}%", flush=True)
    out = {"benchmark": "llama.cpp's perplexity of each GGUF file against our torch eval of the same codes",
           "command": "python " + " ".join(sys.argv), "windows": list(windows.shape), "rows": rows,
           "max_abs_rel_diff": max(abs(r["rel_diff"]) for r in rows), "machine": machine(), "versions": versions()}
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
