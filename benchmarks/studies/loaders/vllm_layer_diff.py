"""Where does vLLM's output differ from ours, layer by layer? For one checkpoint and one 512-token window:
the residual stream after every decoder layer in vLLM (hooks through LLMEngine.apply_model, in the
driver's `hidden_states` task), in our fast path (the kernel `eval` uses, same activation dtype as vLLM)
and in our reference path (float32, packed weights dequantized exactly). Per layer it prints the relative
difference ||a − b|| / ||b|| of vLLM against our fast path, and of our fast path against our reference,
so a kernel that departs from the checkpoint's weights shows as a jump at the layers where it does.

    python benchmarks/studies/loaders/vllm_layer_diff.py /work/serve-models/awq-g64 [--vllm-python PY] [--env K=V ...]

Writes benchmarks/results/vllm_layer_diff_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for common.py
from common import RESULTS, eval_windows  # noqa: E402

from geminicompress.eval.engines.torch_kernels import use_fast_kernels  # noqa: E402
from geminicompress.eval.engines.vllm_engine import run_driver  # noqa: E402
from geminicompress.eval.engines.vllm_eval import engine_dtype, model_path  # noqa: E402
from geminicompress.eval.specs import stored_dtype  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402


@torch.no_grad()
def our_stream(model, window: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after every decoder layer, (tokens, hidden) float32 each."""
    out: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, o: out.append((o[0] if isinstance(o, tuple) else o)[0].float()))
             for layer in model.model.layers]
    model(input_ids=window.view(1, -1), use_cache=False)
    for h in hooks:
        h.remove()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vllm-python", default="/work/.venv-vllm/bin/python")
    ap.add_argument("--env", action="append", default=[], help="K=V for vLLM's process (e.g. VLLM_CPU_INT4_W4A8=0)")
    args = ap.parse_args()
    spec = args.model
    dtype = engine_dtype(spec)
    loaded = load_model(spec, dtype=stored_dtype(spec))
    window = eval_windows(loaded.tokenizer, 1)[0]
    reference = our_stream(loaded.model, window)
    use_fast_kernels(loaded.model, torch.device("cpu"))
    fast = our_stream(loaded.model, window)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "h.pt")
        job = {"model": model_path(spec), "engine": {"dtype": dtype, "enforce_eager": True,
                                                      "enable_prefix_caching": False, "max_model_len": 1024},
               "tasks": [{"kind": "hidden_states", "window": window.tolist(), "path": path}]}
        env = dict(kv.split("=", 1) for kv in args.env)
        result = run_driver(args.vllm_python, job, env=env)
        if result["error"]:
            raise SystemExit(f"vLLM refused {spec}: {result['error']}")
        theirs = torch.load(path)
    rows = []
    for i, (r, f, v) in enumerate(zip(reference, fast, theirs)):
        rows.append({"layer": i, "vllm_vs_fast": round(rel(v, f), 6), "fast_vs_reference": round(rel(f, r), 6),
                     "vllm_vs_reference": round(rel(v, r), 6)})
        print(f"layer {i:2d}  vLLM vs ours ({dtype}) {rows[-1]['vllm_vs_fast']:.5f}   ours {dtype} vs float32 "
              f"{rows[-1]['fast_vs_reference']:.5f}   vLLM vs float32 {rows[-1]['vllm_vs_reference']:.5f}")
    name = Path(spec).name
    out = {"benchmark": "vllm_layer_diff", "model": spec, "dtype": dtype, "env": env, "kernels": result["kernels"],
           "window": "the first 512 tokens of wikitext2-test.txt", "layers": rows,
           "command": f"python benchmarks/studies/loaders/vllm_layer_diff.py {spec}" + "".join(f" --env {e}" for e in args.env),
           "machine": machine(), "versions": versions()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"vllm_layer_diff_{name}{''.join('_' + e.replace('=', '') for e in args.env)}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
