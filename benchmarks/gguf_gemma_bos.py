"""Gemma 3 270M in llama.cpp with BOS-led windows everywhere (issue #59): our default GPTQ -> Q4_0 file (calibrated
on BOS-led windows, and on text-led ones for comparison) against llama.cpp's own Q4_0 with an importance matrix
taken on the same BOS-led calibration windows, every file scored by llama.cpp itself against our F32 export on
the protocol's windows (BOS + 511 text tokens): perplexity, KL over the whole vocabulary (mean, p99), same top
token, file size. Also our torch eval's perplexity of the float model on the same windows (the engines agree).

  python benchmarks/gguf_gemma_bos.py --model /work/models/gemma3-270m --work /work/runs/gguf-bos \
      --ours bos=/work/runs/gguf-bos/ours-bos,text=/work/runs/gguf-bos/ours-text
The `--ours` folders are OUT of `geminicompress quantize MODEL --method gptq --format gguf --data enwiki-sample.txt
--samples 32 --calib-seq-len 512` (add `--frame text` for the text-led one); missing ones are made here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, RESULTS, calibration_ids, eval_windows, perplexity  # noqa: E402
from gguf_bench import importance_matrix, llama_python  # noqa: E402
from gguf_gemma_bench import source_gguf  # noqa: E402

CAL = ["--data", str(DATA / "enwiki-sample.txt"), "--samples", "32", "--calib-seq-len", "512", "--seed", "0"]


def llama_files(model: str, work: Path, python: str) -> dict[str, Path]:
    """Our F32 export of the float model, and llama.cpp's Q4_0 of it with an importance matrix taken on the
    protocol's calibration windows (framed as the tokenizer frames a text: BOS-led for Gemma)."""
    from geminicompress.eval.engines.llama_eval import run_driver
    from geminicompress.formats.gguf_export import GGUFOptions, export
    from geminicompress.models.loading import load_model

    work.mkdir(parents=True, exist_ok=True)
    f32, q40 = work / "float-f32.gguf", work / "llama-q4_0-imatrix.gguf"
    if not f32.is_file():
        export(Path(model), GGUFOptions(embeddings="f32", floats="f32"), source_gguf=source_gguf(), dest=f32)
    imatrix = work / "imatrix.json"
    if not imatrix.is_file():
        calib = calibration_ids(load_model(model).tokenizer, 32)
        assert calib.shape == (32, 512)
        imatrix.write_text(json.dumps(importance_matrix(calib, model)))
    if not q40.is_file():
        task = {"kind": "quantize", "src": str(f32), "dst": str(q40), "ftype": "Q4_0",
                "imatrix": json.loads(imatrix.read_text())}
        result = run_driver(python, {"model": None, "tasks": [task]})
        if result.get("error"):
            raise SystemExit(f"llama.cpp: {result['error']}")
    return {"float-f32": f32, "llama-q4_0-imatrix": q40}


def ours(model: str, spec: str) -> dict[str, Path]:
    """NAME=OUT pairs; an OUT that does not exist is made by our quantize (name 'text': --frame text)."""
    out = {}
    for item in spec.split(","):
        name, folder = item.split("=", 1)
        if not (Path(folder) / "model.gguf").is_file():
            frame = ["--frame", "text"] if name == "text" else []
            subprocess.run(["geminicompress", "quantize", model, "-o", folder, "--method", "gptq", "--format", "gguf",
                            *CAL, *frame, "--threads", "2", "--quiet"], check=True)
        out[f"ours-gptq-q4_0-{name}"] = Path(folder) / "model.gguf"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/models/gemma3-270m")
    ap.add_argument("--work", default="/work/runs/gguf-bos")
    ap.add_argument("--ours", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="gguf_gemma_bos")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    python, work = llama_python(), Path(args.work)
    files = {**llama_files(args.model, work, python), **ours(args.model, args.ours)}
    loaded = load_model(args.model)
    windows = eval_windows(loaded.tokenizer)  # (32, 512): BOS + 511 text tokens each
    torch_ppl = perplexity(loaded.model, windows)
    del loaded
    (work / "windows.json").write_text(json.dumps({"windows": windows.tolist()}))
    others = ",".join(f"{k}={v}" for k, v in files.items() if k != "float-f32")
    subprocess.run([python, str(Path(__file__).with_name("llama_kl.py")), "--windows", str(work / "windows.json"),
                    "--ref", f"float-f32={files['float-f32']}", "--files", others, "--out", str(work / "kl.json"),
                    "--threads", str(args.threads)], check=True)
    scored = json.loads((work / "kl.json").read_text())
    out = {"benchmark": "Gemma 3 270M GGUF in llama.cpp, BOS-led", "command": "python " + " ".join(sys.argv),
           "protocol": f"wikitext2-test.txt, {windows.shape[0]} windows of BOS + {windows.shape[1] - 1} text tokens; "
                       "calibration 32 x 512 enwiki-sample.txt (BOS + 511), seed 0",
           "first_ids": windows[0, :3].tolist(), "torch_float_perplexity": round(torch_ppl, 4), **scored,
           "machine": machine(), "versions": versions()}
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    base = next(r for r in scored["rows"] if r["row"] == "llama-q4_0-imatrix")
    print(f"torch float {torch_ppl:.4f}  llama.cpp float {scored['rows'][0]['perplexity']:.4f}")
    for r in scored["rows"]:
        ratio = f"  KL {r['kl_mean'] / base['kl_mean']:.3f}x llama.cpp's" if "kl_mean" in r else ""
        print(f"{r['row']:28s} {r['file_mb']:8.2f} MB  ppl {r['perplexity']:8.3f}  "
              f"KL {r.get('kl_mean', 0):.4f} p99 {r.get('kl_p99', 0):.3f} top1 {r.get('same_top1', 1):.4f}{ratio}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
