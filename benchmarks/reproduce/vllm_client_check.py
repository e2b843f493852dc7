"""vLLM as a client of every format we write: loads? perplexity ours vs vLLM's, same windows, same dtype.

For each output of the demo model (dense fp32 / bf16, int8 W8A16, W8A8, GPTQ v1 with and without
act-order, GPTQ compressed-tensors, AWQ GEMM and compressed-tensors, RTN ...):

- ours, reference: our loader (packed weights dequantized per call), in the checkpoint's stored dtype;
- ours, fast: what `eval` runs (torch's int4 kernel in bf16 for the int4 formats; int8 modules as loaded);
- vLLM: loads it? (else vLLM's reason, one line), the kernel it says it picked, its perplexity through
  `prompt_logprobs` on the same token ids, in the same activation dtype as our fast path
  (eval/vllm_eval.engine_dtype). With --w4a8-off, the int4 formats again with VLLM_CPU_INT4_W4A8=0: on a CPU
  with AMX, vLLM's CPU build quantizes the activations of int4 layers to int8 by default (W4A8); the
  machine's AMX flag is recorded.

Protocol: benchmarks/common.py (first 16,384 tokens of wikitext2-test.txt, 512-token windows).

    python benchmarks/reproduce/vllm_client_check.py --vllm-python /work/.venv-vllm/bin/python \\
        --models-dir /work/serve-models [--only gptq-g64-noact,awq-g64] [--windows 32]

Writes benchmarks/results/vllm_client_check.json (issue #26 reuses this script for its GPTQ bar).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import RESULTS, eval_windows  # noqa: E402

from geminicompress.eval.engines.torch_kernels import expects_int4, use_fast_kernels  # noqa: E402
from geminicompress.eval.engines.vllm_engine import check_vllm, run_driver  # noqa: E402
from geminicompress.eval.engines.vllm_eval import engine_dtype, model_path  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402

# name -> what it is (the folder under --models-dir; "smollm2-demo" is the fp32 demo itself)
MODELS = {
    "smollm2-demo": "fp32 dense (the demo)",
    "bf16": "bf16 dense copy",
    "int8": "int8 W8A16, compressed-tensors pack-quantized 8-bit (int-quantized before issue #25's writer fix)",
    "w8a8": "w8a8, compressed-tensors int-quantized",
    "gptq-g64-static": "gptq 4-bit g64 v1, default flags (act-order static: desc_act false)",
    "gptq-g64-static-ct": "gptq 4-bit g64 compressed-tensors, default flags (actorder weight)",
    "gptq-w3-g64": "gptq 3-bit g64 v1, default flags",
    "gptq-w4-pc": "gptq 4-bit per channel v1, default flags",
    "gptq-g64": "gptq 4-bit g64 v1, --act-order group (the default before issue #26: desc_act true)",
    "gptq-g64-noact": "gptq 4-bit g64 v1, --no-act-order",
    "gptq-g64-ct": "gptq 4-bit g64 compressed-tensors, --act-order group (the default before issue #26)",
    "gptq-g64-noact-ct": "gptq 4-bit g64 compressed-tensors, --no-act-order",
    "gptq-g64-noact-asym": "gptq 4-bit g64 v1, --no-act-order --asym (zero points stored)",
    "rtn-g64": "rtn 4-bit g64 (its default format)",
    "awq-g64": "awq 4-bit g64 GEMM",
    "awq-g64-ct": "awq 4-bit g64 compressed-tensors",
}


def spec_of(name: str, root: Path) -> str:
    return "smollm2-demo" if name == "smollm2-demo" else str(root / name)


def ensure_derived(root: Path) -> None:
    """bf16: the demo saved in bf16."""
    if not (root / "bf16").exists():
        demo = load_model("smollm2-demo")
        demo.model.to(torch.bfloat16).save_pretrained(root / "bf16")
        demo.tokenizer.save_pretrained(root / "bf16")


def ours(spec: str, windows: torch.Tensor) -> dict:
    """Perplexity through our reference loader (stored dtype) and through the fast path `eval` uses."""
    from geminicompress.eval.specs import stored_dtype

    loaded = load_model(spec, dtype=stored_dtype(spec))
    out = {"dtype_reference": str(stored_dtype(spec)).removeprefix("torch.")}
    t0 = time.perf_counter()
    out["ppl_reference"] = perplexity(loaded.model, windows, "cpu")
    choice = use_fast_kernels(loaded.model, torch.device("cpu"))
    out["fast_kernel"], out["dtype_fast"] = choice.kernel, choice.activation_dtype
    out["ppl_fast"] = out["ppl_reference"] if choice.kernel != "torch-int4-cpu" else perplexity(loaded.model, windows,
                                                                                                 "cpu")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def in_vllm(python: str, spec: str, windows: torch.Tensor, env: dict | None = None, dtype: str | None = None) -> dict:
    job = {"model": model_path(spec), "engine": {"dtype": dtype or engine_dtype(spec), "enforce_eager": True,
                                                  "enable_prefix_caching": False, "max_model_len": 1024, "seed": 0},
           "tasks": [{"kind": "logprobs", "windows": windows.tolist()}]}
    t0 = time.perf_counter()
    result = run_driver(python, job, env=env)
    out = {"dtype": job["engine"]["dtype"], "env": env or {}, "loads": result["error"] is None,
           "error": result["error"], "kernels": result["kernels"], "load_s": result.get("load_s"),
           "seconds": round(time.perf_counter() - t0, 1)}
    if result["error"] is None:
        lps = result["tasks"][0]["logprobs"]
        out["ppl"] = float(torch.tensor([x for w in lps for x in w], dtype=torch.float64).neg().mean().exp())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/work/.venv-vllm/bin/python")
    ap.add_argument("--models-dir", default="/work/serve-models")
    ap.add_argument("--only", default=None, help="comma-separated names (default: every one present)")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--w4a8-off", action="store_true", help="also run int4 formats with VLLM_CPU_INT4_W4A8=0")
    ap.add_argument("--out", default=str(RESULTS / "vllm_client_check.json"))
    args = ap.parse_args()
    root = Path(args.models_dir)
    version = check_vllm(args.vllm_python)
    ensure_derived(root)
    names = args.only.split(",") if args.only else [n for n in MODELS if n == "smollm2-demo" or (root / n).exists()]
    tok = load_model("smollm2-demo").tokenizer
    windows = eval_windows(tok, args.windows)
    out_path = Path(args.out)
    results = json.loads(out_path.read_text())["models"] if out_path.exists() and args.only else {}
    for name in names:
        spec = spec_of(name, root)
        row = {"what": MODELS.get(name, name), "ours": ours(spec, windows), "vllm": in_vllm(args.vllm_python, spec, windows)}
        int4 = expects_int4(json.loads((Path(model_path(spec)) / "config.json").read_text()))
        if args.w4a8_off and int4 and row["vllm"]["loads"]:
            row["vllm_w4a16"] = in_vllm(args.vllm_python, spec, windows, env={"VLLM_CPU_INT4_W4A8": "0"})
        results[name] = row
        print(summary(name, row), flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report(results, args, version), indent=2) + "\n")
    print(f"wrote {out_path}")


def summary(name: str, row: dict) -> str:
    o, v = row["ours"], row["vllm"]
    same = o["ppl_fast"] if v["dtype"] == o["dtype_fast"] else o["ppl_reference"]
    text = f"{name:18s} ours ref {o['ppl_reference']:.4f} ({o['dtype_reference']}) fast {o['ppl_fast']:.4f} ({o['dtype_fast']})"
    if not v["loads"]:
        return text + f"  vLLM refused: {v['error']}"
    text += f"  vLLM {v['ppl']:.4f} ({v['dtype']}, {100 * (v['ppl'] / same - 1):+.2f}%)"
    if "vllm_w4a16" in row and row["vllm_w4a16"].get("ppl"):
        w = row["vllm_w4a16"]["ppl"]
        text += f"  W4A8 off {w:.4f} ({100 * (w / same - 1):+.2f}%)"
    return text + f"  [{'; '.join(v['kernels'])}]"


def report(results: dict, args, version: str) -> dict:
    return {"benchmark": "vllm_client_check", "vllm": version, "windows": args.windows, "seq_len": 512,
            "data": "wikitext2-test.txt (first 16,384 tokens)" if args.windows == 32 else "wikitext2-test.txt",
            "command": f"python benchmarks/reproduce/vllm_client_check.py --vllm-python {args.vllm_python} --models-dir "
                       f"{args.models_dir}" + (f" --only {args.only}" if args.only else ""),
            "machine": {**machine(), "amx": bool(torch.cpu._is_amx_tile_supported())}, "versions": versions(),
            "models": results}


if __name__ == "__main__":
    main()
