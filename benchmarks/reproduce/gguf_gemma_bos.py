"""Gemma 3 270M in llama.cpp with BOS-led windows everywhere (issue #59): our default GPTQ -> Q4_0 file (calibrated
on BOS-led windows, and on text-led ones for comparison) against llama.cpp's own Q4_0 with an importance matrix
taken on the same BOS-led calibration windows, every file scored by llama.cpp itself against our F32 export on
the protocol's windows (BOS + 511 text tokens): perplexity, KL over the whole vocabulary (mean, p99), same top
token, file size. Also our torch eval's perplexity of the float model on the same windows (the engines agree).

  python benchmarks/reproduce/gguf_gemma_bos.py --model /work/models/gemma3-270m --work /work/runs/gguf-bos \
      --ours bos=/work/runs/gguf-bos/ours-bos,text=/work/runs/gguf-bos/ours-text
The `--ours` folders are OUT of `geminicompress quantize MODEL --method gptq --format gguf --data enwiki-sample.txt
--samples 32 --calib-seq-len 512` (add `--frame text` for the text-led one); missing ones are made here.

Other GGUF types (issue #63: same types per tensor as llama.cpp's file, our GPTQ against llama.cpp with its
importance matrix):

  python benchmarks/reproduce/gguf_gemma_bos.py --types IQ4_NL,Q3_K_M,Q2_K --ours none --name gguf_gemma_kquants
The same on the demo (no BOS: its tokenizer adds none; windows of 512 text tokens):

  python benchmarks/reproduce/gguf_gemma_bos.py --model smollm2-demo --work /work/runs/gguf-demo \
      --types Q4_0,IQ4_NL,Q3_K_M,Q2_K,Q4_K_M,Q5_K_M,Q6_K --auto Q4_K_M --ours none --name gguf_demo_kquants
Each type T adds llama.cpp's `llama-T-imatrix` file and ours, `quantize --method gptq --format gguf --gguf-type T`
(WORK/ours-gptq-T), all scored in one llama.cpp pass against the F32 file. `--auto Q3_K_M` adds ours with
`--gguf-type auto --target-size-mb` the size of llama.cpp's Q3_K_M file (WORK/ours-gptq-auto-q3_k_m).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, RESULTS, calibration_ids, eval_windows, perplexity  # noqa: E402
from reproduce.gguf_bench import importance_matrix, llama_python  # noqa: E402
from reproduce.gguf_gemma_bench import source_gguf  # noqa: E402

CAL = ["--data", str(DATA / "enwiki-sample.txt"), "--samples", "32", "--calib-seq-len", "512", "--seed", "0"]


def llama_files(model: str, work: Path, python: str, types: list[str]) -> dict[str, Path]:
    """Our F32 export of the float model, and llama.cpp's file of every type in `types` made from it with an
    importance matrix taken on the protocol's calibration windows (framed as the tokenizer frames a text:
    BOS-led for Gemma)."""
    from geminicompress.eval.engines.llama_eval import demo_f32, run_driver
    from geminicompress.formats.gguf_export import GGUFOptions, export
    from geminicompress.models.loading import load_model

    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "float-f32.gguf"
    if not f32.is_file() and model == "smollm2-demo":  # llama.cpp's exact dequantization of the shipped Q4_1 file
        f32.write_bytes(demo_f32(python).read_bytes())
    elif not f32.is_file():  # ours of the float checkpoint, its tokenizer from the shipped Q4_K_M file
        export(Path(model), GGUFOptions(embeddings="f32", floats="f32"), source_gguf=source_gguf(), dest=f32)
    imatrix = work / "imatrix.json"
    if not imatrix.is_file():
        calib = calibration_ids(load_model(model).tokenizer, 32)
        assert calib.shape == (32, 512)
        imatrix.write_text(json.dumps(importance_matrix(calib, model)))
    files = {"float-f32": f32}
    for gtype in types:
        dst = work / f"llama-{gtype.lower()}-imatrix.gguf"
        if not dst.is_file():
            task = {"kind": "quantize", "src": str(f32), "dst": str(dst), "ftype": gtype,
                    "imatrix": json.loads(imatrix.read_text())}
            result = run_driver(python, {"model": None, "tasks": [task]})
            if result.get("error"):
                raise SystemExit(f"llama.cpp: {result['error']}")
        files[f"llama-{gtype.lower()}-imatrix"] = dst
    return files


def ours_typed(model: str, work: Path, types: list[str], ours_q4_0: bool) -> dict[str, Path]:
    """Our default GPTQ at each GGUF type (`--gguf-type T`: llama-quantize's per-tensor types); Q4_0 only when no
    --ours rows give it."""
    out = {}
    for gtype in types:
        if gtype == "Q4_0" and ours_q4_0:
            continue  # the --ours rows
        folder = work / f"ours-gptq-{gtype.lower()}"
        if not (folder / "model.gguf").is_file():
            subprocess.run(["geminicompress", "quantize", model, "-o", str(folder), "--method", "gptq", "--format",
                            "gguf", "--gguf-type", gtype, *CAL, "--threads", "2", "--quiet"], check=True)
        out[f"ours-gptq-{gtype.lower()}-bos"] = folder / "model.gguf"
    return out


def ours_auto(model: str, work: Path, mixes: list[str]) -> dict[str, Path]:
    """Our `--gguf-type auto` at the size of llama.cpp's file of each mix (made first by llama_files)."""
    out = {}
    for mix in mixes:
        folder, ref = work / f"ours-gptq-auto-{mix.lower()}", work / f"llama-{mix.lower()}-imatrix.gguf"
        if not (folder / "model.gguf").is_file():
            size = f"{ref.stat().st_size / 1e6:.6f}"
            subprocess.run(["geminicompress", "quantize", model, "-o", str(folder), "--method", "gptq", "--format",
                            "gguf", "--gguf-type", "auto", "--target-size-mb", size, *CAL, "--threads", "2",
                            "--quiet"], check=True)
        out[f"ours-gptq-auto-{mix.lower()}"] = folder / "model.gguf"
    return out


def ours(model: str, spec: str) -> dict[str, Path]:
    """NAME=OUT pairs; an OUT that does not exist is made by our quantize (name 'text': --frame text)."""
    out = {}
    for item in spec.split(","):
        if item == "none":
            continue
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
    ap.add_argument("--ours", required=True, help="NAME=OUT,... our Q4_0 rows ('none': only --types rows)")
    ap.add_argument("--types", default="Q4_0", help="GGUF types, comma separated: llama.cpp's file with an importance "
                    "matrix and ours (Q4_0: the --ours rows)")
    ap.add_argument("--auto", default="", help="mixes, comma separated: ours with --gguf-type auto at the size of "
                    "llama.cpp's file of that mix")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="gguf_gemma_bos")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    python, work = llama_python(), Path(args.work)
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    auto = [t.strip().upper() for t in args.auto.split(",") if t.strip()]
    files = {**llama_files(args.model, work, python, list(dict.fromkeys(types + auto))),
             **ours(args.model, args.ours), **ours_typed(args.model, work, types, args.ours != "none"), **ours_auto(args.model, work, auto)}
    loaded = load_model(args.model)
    windows = eval_windows(loaded.tokenizer)  # (32, 512): BOS + 511 text tokens each
    cached = work / "torch_float_ppl.json"  # the float model's torch perplexity on these windows, taken once
    saved = json.loads(cached.read_text()) if cached.is_file() else {}
    if saved.get("windows") == windows[:, :8].tolist():
        torch_ppl = saved["perplexity"]
    else:
        torch_ppl = perplexity(loaded.model, windows)
        cached.write_text(json.dumps({"windows": windows[:, :8].tolist(), "perplexity": torch_ppl}))
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
    print(f"torch float {torch_ppl:.4f}  llama.cpp float {scored['rows'][0]['perplexity']:.4f}")
    by_row = {r["row"]: r for r in scored["rows"]}
    for r in scored["rows"]:
        gtype = r["row"].split("-")[-1 if "-auto-" in r["row"] else 2] if r["row"].startswith("ours-gptq-") else ""
        base = by_row.get(f"llama-{gtype}-imatrix")
        ratio = f"  KL {r['kl_mean'] / base['kl_mean']:.3f}x llama.cpp's" if base and "kl_mean" in r else ""
        print(f"{r['row']:28s} {r['file_mb']:8.2f} MB  ppl {r['perplexity']:8.3f}  "
              f"KL {r.get('kl_mean', 0):.4f} p99 {r.get('kl_p99', 0):.3f} top1 {r.get('same_top1', 1):.4f}{ratio}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
