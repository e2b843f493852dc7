"""A light real-weight check of the solver (about 15 s): GPTQ vs round-to-nearest on decoder layer 0's
stacked q/k/v projection of the demo model, on 8 calibration windows of 512 tokens from enwiki-sample.txt.

Reports the relative output error ‖XŴᵀ − XWᵀ‖² / ‖XWᵀ‖² on the calibration inputs X, and the solver's
time (one thread). Not the benchmark protocol (that is gptq_bench.py): a quick sanity figure.

  python benchmarks/gptq_layer_check.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    torch.set_num_threads(1)
    from geminicompress.compress.gptq.solver import gptq_quantize
    from geminicompress.compress.grid import QuantSpec, rtn_quantize
    from geminicompress.compress.hessian import HessianAccumulator
    from geminicompress.compress.layerwise import capture_inputs
    from geminicompress.data.windows import calibration_windows
    from geminicompress.machine import machine, versions
    from geminicompress.models.loading import _demo_dir, load_model

    loaded = load_model(str(_demo_dir()))
    ids = calibration_windows(loaded.tokenizer, str(ROOT.parent / "shared" / "data" / "enwiki-sample.txt"), 8, 512, seed=0)
    inputs = capture_inputs(loaded.model, ids, torch.device("cpu"))
    layer = loaded.model.model.layers[0]
    with torch.no_grad():
        X = torch.cat([layer.input_layernorm(h) for h in inputs.hidden]).reshape(-1, layer.self_attn.q_proj.in_features)
        W = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    acc = HessianAccumulator(X.shape[1])
    acc.add_batch(X)
    ref = X @ W.T
    rows = {}
    for name, spec in {"w4-pc": QuantSpec(4, -1), "w3-g64": QuantSpec(3, 64)}.items():
        t0 = time.perf_counter()
        qw, _ = gptq_quantize(W, acc.H, spec, act_order=True, static_groups=True)
        seconds = time.perf_counter() - t0
        rel = lambda Wq: float(((X @ Wq.T - ref) ** 2).sum() / (ref**2).sum())  # noqa: E731
        rows[name] = {"gptq_rel_output_error": rel(qw.dequantize()), "rtn_rel_output_error": rel(rtn_quantize(W, spec).dequantize()),
                      "solver_seconds": round(seconds, 3), "weight": list(W.shape)}
    result = {"check": "gptq layer 0 q/k/v", "rows": rows, "machine": machine(), "versions": versions()}
    (ROOT / "benchmarks" / "results" / "gptq_layer_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
