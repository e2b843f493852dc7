"""Where a pair of GGUF files of one mix differs (issue #63; first: why the demo's Q5_K_M pair is not ranked):
per tensor kind, the relative weight error (mean squared error over mean square) of llama.cpp's file and of ours
against the F32 file, both of one mix. The demo's float
weights lie on a Q4_1 grid (block 32, d·q + m, q in 0..15), which Q5_1 (block 32, d'·q' + m', q' in 0..31) holds
exactly with d' = d, m' = m: llama.cpp's weighted scale search finds that grid, our GPTQ (which minimises the
layer's output error, not the weights') does not.

  python benchmarks/studies/gguf/source_grid_check.py --f32 WORK/float-f32.gguf \
      --llama WORK/llama-q5_k_m-imatrix.gguf --ours WORK/ours-gptq-q5_k_m/model.gguf --name gguf_source_grid_demo_q5_k_m
(the files of benchmarks/reproduce/gguf_gemma_bos.py --model smollm2-demo --types Q5_K_M). Prints a table, writes
benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, quants

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import RESULTS  # noqa: E402


def linears(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (type, dequantized weights flat)} of every decoder linear in the file."""
    out = {}
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            out[t.name] = (t.tensor_type.name, quants.dequantize(t.data, t.tensor_type).reshape(-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--f32", required=True)
    ap.add_argument("--llama", required=True)
    ap.add_argument("--ours", required=True)
    ap.add_argument("--name", default="gguf_source_grid_demo_q5_k_m")
    args = ap.parse_args()
    f32, theirs, ours = linears(args.f32), linears(args.llama), linears(args.ours)
    groups: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for name, (_, w) in f32.items():
        power = float((w.astype(np.float64) ** 2).mean())
        errs = [float(((f[name][1] - w).astype(np.float64) ** 2).mean()) / power for f in (theirs, ours)]
        groups.setdefault((name.split(".")[2], theirs[name][0], ours[name][0]), []).append(tuple(errs))
    rows = [{"kind": k[0], "llama_type": k[1], "our_type": k[2], "tensors": len(v),
             "llama_rel_mse": float(np.mean([e[0] for e in v])), "ours_rel_mse": float(np.mean([e[1] for e in v]))}
            for k, v in sorted(groups.items())]
    for r in rows:
        print(f"{r['kind']:12s} {r['llama_type']:5s} {r['tensors']:3d}  llama.cpp {r['llama_rel_mse']:.2e}  "
              f"ours {r['ours_rel_mse']:.2e}")
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps({"benchmark": "relative weight error per tensor kind against the F32 file",
                                "command": "python " + " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
