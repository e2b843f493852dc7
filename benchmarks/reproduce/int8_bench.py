"""INT8 on the demo model: perplexity drift, decode/prefill latency and linear-weight bytes, side by side.

Variants (one run, same model, same data, 2 threads):
  fp32                     the dequantized SmolLM2-135M-Instruct
  ours int8                W8A16, per-channel int8 weights (geminicompress quantize --method int8)
  ours w8a8                + dynamic per-token int8 activations, fbgemm INT8 kernels
  ours w8a8 + SQ 0.5/0.8   + SmoothQuant alpha 0.5 / 0.8 (32 enwiki calibration windows of 512, seed 0)
  torch quantize_dynamic   torch.ao.quantization.quantize_dynamic, default qconfig (per-tensor weights)
  torchao int8wo / w8a8    torchao Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig (if torchao imports)
Our variants are written to disk with the real exporter and loaded back, so what is measured is what ships.
Every variant keeps lm_head (tied to the embeddings) in float.

Perplexity: the first 20,480 tokens of wikitext2-test.txt in 40 non-overlapping windows of 512.
Decode: a 128-token prompt, then 32 greedy steps with a KV cache, batch 1; the median over all steps of
all repeats is the time per output token (TPOT). Prefill: one forward of a 512-token window. Timings are
interleaved across variants (round robin) so that machine load drifts hit every variant alike.

    python benchmarks/reproduce/int8_bench.py            # full run
    python benchmarks/reproduce/int8_bench.py --quick    # 8 windows, 2 repeats

torchao is optional: when it is not importable, the script creates /work/venvs/torchao
(--system-site-packages, `pip install --no-deps torchao`) and re-runs itself there; --no-torchao skips it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
VENV = Path("/work/venvs/torchao")


def ensure_torchao(args) -> bool:
    try:
        import torchao  # noqa: F401

        return True
    except ImportError:
        pass
    if args.no_torchao or os.environ.get("INT8_BENCH_REEXEC"):
        return False
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "--no-deps", "torchao"], check=True)
    env = dict(os.environ, INT8_BENCH_REEXEC="1")
    os.execve(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), *sys.argv], env)


# --------------------------------------------------------------------------- variants


def ours(model, tok, method: str, alpha: float | None, calib: torch.Tensor, workdir: Path):
    from geminicompress.compress.int8 import stage
    from geminicompress.compress.int8.config import Int8Stage
    from geminicompress.models.loading import load_model
    from geminicompress.host.progress import NullProgress
    from geminicompress.runtime.recipes.schema import Recipe

    m = copy.deepcopy(model)
    recipe = Recipe(model="smollm2-demo", stages=[{"type": "quantize", "method": method}])
    ctx = SimpleNamespace(model=m, tokenizer=tok, recipe=recipe, progress=NullProgress(), exporter=None,
                          calibration=lambda data=None, samples=None, seq_len=None: calib)
    t0 = time.perf_counter()
    summary = stage.run(Int8Stage(method=method, smoothquant_alpha=alpha), ctx)
    out = workdir / f"{method}-{alpha}"
    ctx.exporter(m, tok, out)
    seconds = time.perf_counter() - t0
    loaded = load_model(str(out)).model
    kernels = sorted({layer["kernel"] for layer in summary["layers"]})
    return loaded, {"quantize_seconds": round(seconds, 1), "kernels": kernels, "disk_bytes": _dir_bytes(out)}


def torch_dynamic(model):
    from torch.ao.quantization import quantize_dynamic

    m = copy.deepcopy(model)
    names = {n for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and n != "lm_head"}
    return quantize_dynamic(m, {n: torch.ao.quantization.default_dynamic_qconfig for n in names}, dtype=torch.qint8), {}


def torchao_variant(model, kind: str):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    m = copy.deepcopy(model)
    config = Int8WeightOnlyConfig() if kind == "wo" else Int8DynamicActivationInt8WeightConfig()
    quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "lm_head")
    return m, {"torchao": __import__("torchao").__version__}


# --------------------------------------------------------------------------- measurements


sys.path.insert(0, str(ROOT / "benchmarks"))  # for common.py
from common import perplexity  # noqa: E402  (the package's, batched)


@torch.no_grad()
def decode_times(model, prompt: torch.Tensor, steps: int) -> list[float]:
    """Seconds per decode step (batch 1, one token, KV cache) after a prefill of `prompt`."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(prompt.unsqueeze(0), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return times


@torch.no_grad()
def prefill_time(model, window: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(window.unsqueeze(0), use_cache=False)
    return time.perf_counter() - t0


def linear_bytes(model) -> int:
    """Bytes of the decoder linears' weights (+ scales/packed params), lm_head/embeddings excluded."""
    total = 0
    for name, mod in model.named_modules():
        if not name.startswith("model.layers.") or name.count(".") != 4:
            continue
        if isinstance(mod, nn.Linear) and not hasattr(mod.weight, "tensor_impl") and type(mod.weight) is nn.Parameter:
            total += mod.weight.numel() * mod.weight.element_size()
        elif hasattr(mod, "weight_scale"):
            total += mod.weight.numel() * mod.weight.element_size() + mod.weight_scale.numel() * 4
        elif hasattr(mod, "_packed_params"):  # torch quantize_dynamic
            w, _ = mod._packed_params._weight_bias()
            total += w.numel() + 8  # int8 codes + one scale/zero
        elif isinstance(mod, nn.Linear):  # torchao tensor subclass: int8 data + per-row scale
            total += mod.weight.numel() + mod.weight.shape[0] * 4
    return total


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 perplexity windows, 2 timing repeats")
    ap.add_argument("--smoke", action="store_true", help="2 windows, 1 repeat, 4 steps: checks the script runs")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    have_torchao = ensure_torchao(args)
    torch.set_num_threads(2)
    torch.manual_seed(0)

    from geminicompress.data.windows import calibration_windows, pack_windows, tokenize
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    n_windows, repeats = (8, 2) if args.quick else (40, args.repeats)
    if args.smoke:
        n_windows, repeats, args.steps = 2, 1, 4
    base = load_model("smollm2-demo")
    model, tok = base.model.eval(), base.tokenizer
    ids = tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), max_tokens=20_480)
    windows = pack_windows(ids, 512, n_windows)
    calib = calibration_windows(tok, str(DATA / "enwiki-sample.txt"), 16 if args.quick or args.smoke else 32, 512,
                                seed=0)
    prompt = windows[0, :128]

    workdir = Path(tempfile.mkdtemp(prefix="int8-bench-"))
    builders = {
        "fp32": lambda: (model, {}),
        "ours int8 (W8A16)": lambda: ours(model, tok, "int8", None, calib, workdir),
        "ours w8a8": lambda: ours(model, tok, "w8a8", None, calib, workdir),
        "ours w8a8 + SmoothQuant 0.5": lambda: ours(model, tok, "w8a8", 0.5, calib, workdir),
        "ours w8a8 + SmoothQuant 0.8": lambda: ours(model, tok, "w8a8", 0.8, calib, workdir),
        "torch quantize_dynamic (per-tensor)": lambda: torch_dynamic(model),
    }
    if have_torchao:
        builders["torchao int8 weight-only"] = lambda: torchao_variant(model, "wo")
        builders["torchao int8 dyn-act int8 weight"] = lambda: torchao_variant(model, "w8a8")

    variants, rows = {}, {}
    for name, build in builders.items():
        print(f"[{name}] building", flush=True)
        m, extra = build()
        variants[name] = m.eval()
        t0 = time.perf_counter()
        ppl = perplexity(m, windows)
        rows[name] = {"perplexity": ppl, "ppl_seconds": round(time.perf_counter() - t0, 1),
                      "linear_bytes": linear_bytes(m), **extra}
        print(f"[{name}] ppl {ppl:.4f}", flush=True)

    tpot = {n: [] for n in variants}
    prefill = {n: [] for n in variants}
    for name, m in variants.items():  # warm-up (packing, first-call allocations)
        decode_times(m, prompt, 4)
        prefill_time(m, windows[0])
    for r in range(repeats):
        for name, m in variants.items():
            tpot[name] += decode_times(m, prompt, args.steps)
            prefill[name].append(prefill_time(m, windows[r % len(windows)]))
        print(f"timing round {r + 1}/{repeats} done", flush=True)

    ref = rows["fp32"]
    for name, row in rows.items():
        row["ppl_drift_pct"] = 100 * (row["perplexity"] / ref["perplexity"] - 1)
        row["tpot_ms_median"] = 1000 * statistics.median(tpot[name])
        row["tpot_ms_iqr"] = [1000 * q for q in _quartiles(tpot[name])]
        row["prefill_ms_median"] = 1000 * statistics.median(prefill[name])
        row["linear_bytes_ratio"] = row["linear_bytes"] / ref["linear_bytes"]
    for name, row in rows.items():
        row["tpot_ratio"] = row["tpot_ms_median"] / ref["tpot_ms_median"]
        row["prefill_ratio"] = row["prefill_ms_median"] / ref["prefill_ms_median"]

    bars = {
        "w8a8 drift <= 1%": rows["ours w8a8"]["ppl_drift_pct"] <= 1.0,
        "w8a8 TPOT <= 0.75x fp32": rows["ours w8a8"]["tpot_ratio"] <= 0.75,
        "w8a8+SQ0.5 drift <= 1%": rows["ours w8a8 + SmoothQuant 0.5"]["ppl_drift_pct"] <= 1.0,
        "w8a8+SQ0.5 TPOT <= 0.75x fp32": rows["ours w8a8 + SmoothQuant 0.5"]["tpot_ratio"] <= 0.75,
        "w8a8+SQ0.8 drift <= 1%": rows["ours w8a8 + SmoothQuant 0.8"]["ppl_drift_pct"] <= 1.0,
        "w8a8+SQ0.8 TPOT <= 0.75x fp32": rows["ours w8a8 + SmoothQuant 0.8"]["tpot_ratio"] <= 0.75,
        "int8 drift <= 0.3%": rows["ours int8 (W8A16)"]["ppl_drift_pct"] <= 0.3,
        "int8 linear bytes <= 0.27x": rows["ours int8 (W8A16)"]["linear_bytes_ratio"] <= 0.27,
    }
    print_table(rows, n_windows, repeats, args.steps)
    for k, v in bars.items():
        print(f"bar {k}: {'MET' if v else 'NOT MET'}")
    result = {
        "protocol": {"ppl_tokens": int(windows.numel()), "ppl_windows": n_windows, "seq_len": 512,
                     "calibration": f"{calib.shape[0]} x 512 enwiki-sample.txt seed 0", "decode_prompt": 128,
                     "decode_steps": args.steps, "repeats": repeats, "threads": torch.get_num_threads(),
                     "quick": args.quick},
        "rows": rows, "bars": bars, "versions": versions(), "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "under_bench_lock": bool(os.environ.get("GC_BENCH_LOCKED")),
    }
    if args.smoke:
        return
    out = ROOT / "benchmarks" / "results" / ("int8_bench_quick.json" if args.quick else "int8_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def _quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def print_table(rows: dict, n_windows: int, repeats: int, steps: int) -> None:
    print(f"\nSmolLM2-135M, wikitext2 {n_windows} x 512, decode batch 1 ({repeats} x {steps} steps), 2 threads")
    print("| variant | perplexity | drift | TPOT ms (median) | TPOT vs fp32 | prefill 512 ms | prefill vs fp32 | linear bytes vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity']:.3f} | {r['ppl_drift_pct']:+.2f}% | {r['tpot_ms_median']:.2f} | "
              f"{r['tpot_ratio']:.2f}x | {r['prefill_ms_median']:.0f} | {r['prefill_ratio']:.2f}x | "
              f"{r['linear_bytes_ratio']:.3f} |")


if __name__ == "__main__":
    main()
