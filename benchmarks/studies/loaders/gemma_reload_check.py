"""Every Gemma 3 output loads back in plain transformers with the logits of our in-process model (issue #36).

For each method (int8, w8a8, rtn, gptq, awq, magnitude, wanda, sparsegpt, and streamed runs): the output
is made by the CLI when RUNS/<name> does not exist yet (`--run`), then
- `verified`: report.json's `export.verified`, the run's own check (our loader on OUT against the model the
  run computed in process: max |Δlogit|, 0 when both hold the same values);
- ours: OUT loaded by geminicompress's loader in float32, logits on `--tokens` tokens of WikiText-2;
- transformers: `AutoModelForCausalLM.from_pretrained(OUT)` in `--dtype` (float32: the CPU has no fast
  float16 matmul and Gemma's activations overflow float16), through whatever package the format needs
  (compressed-tensors, GPTQModel + optimum); what fails to load is recorded with its first line;
- compared: max and mean |Δlogit|, relative error ‖Δ‖/‖ours‖, argmax agreement; and for scale the same
  figures of ours against the float model (what the compression itself moved).
So "transformers matches our in-process model" = transformers vs ours (this script) + ours vs in-process
(the run's `verified`).

The quantized formats need their packages next to transformers. A plain `pip install gptqmodel` pulls CUDA
torch, so this runs in a venv that sees the system packages (docs/formats.md):
  python -m venv --system-site-packages /work/venvs/gptqmodel
  /work/venvs/gptqmodel/bin/pip install --no-deps gptqmodel optimum pypcre logbar tokenicer device-smi \
      defuser threadpoolctl compressed-tensors loguru
  /work/venvs/gptqmodel/bin/python benchmarks/studies/loaders/gemma_reload_check.py --model /work/gemma3-270m \
      --runs /work/g36-gemma --json benchmarks/results/gemma_reload_check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CAL = ["--data", "/work/shared/data/enwiki-sample.txt", "--samples", "8", "--calib-seq-len", "256"]
# name -> the CLI arguments after MODEL (OUT and --force are added)
RUNS: dict[str, list[str]] = {
    "int8": ["quantize", "--method", "int8", *CAL],
    "w8a8": ["quantize", "--method", "w8a8", *CAL],
    "rtn4": ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "64"],
    "gptq4": ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "64", *CAL],
    "awq4": ["quantize", "--method", "awq", "--bits", "4", "--group-size", "64", *CAL],
    "mag": ["prune", "--method", "magnitude", "--sparsity", "0.4"],
    "wanda-stream": ["prune", "--method", "wanda", "--sparsity", "0.4", *CAL, "--stream"],
    "sgpt": ["prune", "--method", "sparsegpt", "--sparsity", "0.4", *CAL],
    "gptq4-stream": ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "64", *CAL, "--stream"],
}


def make(model: str, out: Path, args: list[str], threads: int) -> None:
    cmd = [sys.executable, "-m", "geminicompress", args[0], model, *args[1:], "-o", str(out), "--force",
           "--threads", str(threads)]
    print("running", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def text_ids(tokenizer, n: int) -> torch.Tensor:
    text = Path("/work/shared/data/wikitext2-test.txt").read_text()[: 40 * n]
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits.float()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    d = (got - ref).abs()
    return {"max_abs_diff": float(f"{float(d.max()):.4g}"), "mean_abs_diff": float(f"{float(d.mean()):.4g}"),
            "rel_error": float(f"{float((got - ref).norm() / ref.norm()):.4g}"),
            "argmax_agreement": round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4)}


def float_activations(model) -> bool:
    """Our W8A8 modules replaced, in place, by float linears of their dequantized weights (activations no longer
    quantized: what transformers runs a compressed-tensors int-quantized checkpoint as on a CPU). False when the
    model has none."""
    import torch.nn as nn

    from geminicompress.core.arch import set_module
    from geminicompress.kernels.int8 import W8A8Linear

    names = [n for n, m in model.named_modules() if isinstance(m, W8A8Linear)]
    for name in names:
        m = model.get_submodule(name)
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        linear.weight.data = m.dequantized_weight()
        if m.bias is not None:
            linear.bias.data = m.bias.detach().float()
        set_module(model, name, linear)
    return bool(names)


@torch.no_grad()
def activation_grid(model, name: str, weight: torch.Tensor, ids: torch.Tensor) -> dict:
    """Linear `name` of the transformers model, its input and output captured during a forward, against our
    dequantized weight with the input fake-quantized per token on two symmetric grids: [-127, 127] with scale
    max|x|/127 and [-128, 127] with scale max|x|/127.5 (relative output error of each; 0: that grid exactly)."""
    got: dict = {}
    handle = model.get_submodule(name).register_forward_hook(lambda m, i, o: got.update(x=i[0].float(), y=o.float()))
    model(ids, use_cache=False)
    handle.remove()
    x, y = got["x"], got["y"]
    top = x.abs().amax(-1, keepdim=True)
    out = {"linear": name, "float_activations": float((x @ weight.T - y).norm() / y.norm())}
    for label, levels, lo in (("sym127", 127.0, -127), ("sym127.5", 127.5, -128)):
        scale = top / levels
        xq = (x / scale).round().clamp(lo, 127) * scale
        out[label] = float(f"{float((xq @ weight.T - y).norm() / y.norm()):.3g}")
    out["float_activations"] = float(f"{out['float_activations']:.3g}")
    return out


def hf_load(out: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, device_map="cpu").eval()


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check(name: str, out: Path, ids: torch.Tensor, float_logits: torch.Tensor, dtype: torch.dtype) -> dict:
    from geminicompress.models.loading import load_model

    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    row: dict = {"name": name, "command": " ".join(str(c) for c in report.get("command", [])[1:]),
                 "format": report["export"].get("format"),
                 "quant_method": qc.get("quant_method"), "ct_format": qc.get("format"),
                 "verified": report["export"].get("verified")}
    ours = load_model(str(out), dtype=torch.float32, tokenizer=False).model.eval()
    a = logits(ours, ids)
    probe = "model.layers.3.mlp.down_proj"
    w8a8_weight = ours.get_submodule(probe).dequantized_weight() if hasattr(ours.get_submodule(probe), "weight_scale") \
        and "int-quantized" == qc.get("format") else None
    a_float_act = logits(ours, ids) if float_activations(ours) else None
    del ours
    gc.collect()
    row["ours_vs_float"] = compare(float_logits, a)
    t0 = time.perf_counter()
    try:
        theirs = hf_load(out, dtype)
    except Exception as exc:  # noqa: BLE001  (any failure to load is the finding, recorded in one line)
        row["transformers"] = {"loads": False, "error": first_line(exc)}
        return row
    load_s = time.perf_counter() - t0
    linear = theirs.model.layers[0].self_attn.q_proj
    try:
        b = logits(theirs, ids)
    except Exception as exc:  # noqa: BLE001
        row["transformers"] = {"loads": True, "runs": False, "error": first_line(exc),
                               "q_proj_class": f"{type(linear).__module__}.{type(linear).__name__}"}
        return row
    row["transformers"] = {"loads": True, "runs": True, "dtype": str(dtype).removeprefix("torch."),
                           "q_proj_class": f"{type(linear).__module__}.{type(linear).__name__}",
                           "load_seconds_busy_machine": round(load_s, 1), **compare(a, b),
                           "vs_float": compare(float_logits, b)}
    if a_float_act is not None:  # W8A8: how transformers quantizes the activations
        row["transformers"]["vs_ours_float_activations"] = compare(a_float_act, b)
        row["transformers"]["one_linear"] = activation_grid(theirs, probe, w8a8_weight, ids)
    del theirs
    gc.collect()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/work/gemma3-270m")
    ap.add_argument("--runs", type=Path, required=True, help="folder of the outputs, RUNS/<name>")
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    ap.add_argument("--run", action="store_true", help="make the outputs that do not exist yet")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/gemma_reload_check.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(args.threads))
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from geminicompress.host.machine import versions

    names = [n for n in RUNS if not args.only or n in args.only.split(",")]
    for name in names:
        if args.run and not (args.runs / name / "report.json").exists():
            make(args.model, args.runs / name, RUNS[name], args.threads)
    ids = text_ids(AutoTokenizer.from_pretrained(args.model), args.tokens)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    float_logits = logits(base, ids)
    del base
    packages = {}
    for pkg in ("compressed_tensors", "gptqmodel", "optimum"):
        try:
            packages[pkg] = __import__(pkg).__version__
        except Exception as exc:  # noqa: BLE001
            packages[pkg] = f"not importable: {first_line(exc)}"
    rows = []
    for name in names:
        out = args.runs / name
        if not (out / "report.json").exists():
            rows.append({"name": name, "missing": str(out)})
            continue
        row = check(name, out, ids, float_logits, getattr(torch, args.dtype))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.only and args.json.exists():  # a partial rerun replaces its rows of the earlier result
        mine = {r["name"] for r in rows}
        rows = [r if r["name"] not in mine else next(x for x in rows if x["name"] == r["name"])
                for r in json.loads(args.json.read_text())["rows"]] + \
            [r for r in rows if r["name"] not in {x["name"] for x in json.loads(args.json.read_text())["rows"]}]
    result = {"model": args.model, "tokens": int(ids.shape[1]), "text": "wikitext2-test.txt (first tokens)",
              "transformers": transformers.__version__, "packages": packages, "versions": versions(), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| output | format | ours vs in-process (run's check) | transformers loads | transformers vs ours: max abs Δlogit, rel. error, argmax agree | ours vs float: rel. error, argmax agree |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['name']} | (not made) | | | | |")
            continue
        v = r.get("verified") or {}
        t = r["transformers"]
        fmt = r["format"] or "dense"
        if t.get("runs"):
            hf = f"{t['max_abs_diff']:.3g}, {t['rel_error']:.2e}, {100 * t['argmax_agreement']:.1f} %"
            if "vs_float" in t:
                hf += f"; vs float: {t['vs_float']['rel_error']:.3g}, {100 * t['vs_float']['argmax_agreement']:.1f} %"
            if "vs_ours_float_activations" in t:
                f = t["vs_ours_float_activations"]
                hf += (f"; vs ours with float activations: {f['max_abs_diff']:.3g}, {f['rel_error']:.2e}, "
                       f"{100 * f['argmax_agreement']:.1f} %")
            loads = f"yes ({t['q_proj_class'].rsplit('.', 1)[1]})"
        else:
            hf, loads = "", f"no: {t['error']}"
        of = r["ours_vs_float"]
        lines.append(f"| {r['name']} | {fmt} | {v.get('max_abs_logit_diff')} | {loads} | {hf} | "
                     f"{of['rel_error']:.3g}, {100 * of['argmax_agreement']:.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
