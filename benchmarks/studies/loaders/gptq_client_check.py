"""Real-client check: transformers' `from_pretrained(OUT)` (through GPTQModel) loads our `gptq` output
and gives the same logits as geminicompress's own loader.

Needs gptqmodel (and optimum, which transformers' GPTQ loader imports) next to transformers. A plain
`pip install gptqmodel` pulls CUDA torch; instead (the commands this check was run with: the new venv sees
the shared venv's CPU torch and transformers through a .pth file):
  /work/venv/bin/python -m venv /work/venvs/gptqmodel
  /work/venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
      > /work/venvs/gptqmodel/lib/python3.11/site-packages/_shared_venv.pth
  /work/venvs/gptqmodel/bin/pip install --no-deps gptqmodel optimum pypcre logbar tokenicer device-smi defuser threadpoolctl
  PYTHONPATH=$PWD GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqmodel/bin/python benchmarks/studies/loaders/gptq_client_check.py OUT [OUT ...]
Prints one JSON line per checkpoint: max |Δlogit|, relative error, argmax agreement, kernel used.
With --ppl-windows N it also gives both loaders' perplexity on the benchmark protocol's first N windows
(common.eval_windows: wikitext2-test.txt, 512 tokens each; 32 = the protocol's 16,384 tokens), the client
in --ppl-dtype (float32 by default: the CPU has no fast float16 matmul), ours in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-windows", type=int, default=0, help="also compare perplexity on this many eval windows")
    ap.add_argument("--ppl-dtype", default="float32", help="dtype the client model is loaded in for perplexity")
    ap.add_argument("--loader", choices=["transformers", "gptqmodel"], default="transformers",
                    help="transformers' from_pretrained (through GPTQModel), or GPTQModel.load itself: the one "
                         "that reads per-module `dynamic` overrides (mixed precision; transformers' GPTQConfig "
                         "has no such field)")
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    torch.set_num_threads(args.threads)
    import gptqmodel
    import transformers

    from geminicompress.models.loading import load_model

    failed = False
    for out in args.outs:
        ours = load_model(out)
        ids = torch.randint(0, ours.model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        theirs = client_load(out, torch.float16, args.loader)
        load_s = time.perf_counter() - t0
        theirs.eval()
        with torch.no_grad():
            a = ours.model.to(torch.float16)(ids).logits.float()
            b = theirs(ids).logits.float()
        kernels = sorted({type(m).__name__ for m in theirs.modules() if type(m).__module__.startswith("gptqmodel")})
        result = {
            "checkpoint": out, "transformers": transformers.__version__, "gptqmodel": gptqmodel.__version__,
            "kernels": kernels, "load_seconds": round(load_s, 2),
            "max_abs_diff": float((a - b).abs().max()),
            "rel_error": float((a - b).norm() / a.norm()),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        }
        if args.ppl_windows:
            result.update(_perplexities(out, ours.tokenizer, args.ppl_windows, getattr(torch, args.ppl_dtype), args.loader))
            failed |= abs(result["ppl_rel_diff"]) > 0.005
        failed |= not kernels or result["rel_error"] > 1e-2
        print(json.dumps(result))
    return 1 if failed else 0


def client_load(out: str, dtype: torch.dtype, loader: str):
    """The checkpoint as the client loads it: an nn.Module returning logits."""
    if loader == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        # the plain torch kernel: GPTQModel's auto choice for float32 on CPU (TorchFusedLinear) is 4-bit only
        return GPTQModel.load(out, device="cpu", dtype=dtype, backend=BACKEND.TORCH).model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, device_map="cpu")


def _perplexities(out: str, tokenizer, n: int, dtype: torch.dtype, loader: str) -> dict:
    """Perplexity of the checkpoint as the client loads it (in dtype) and as geminicompress loads it."""
    from pathlib import Path

    from geminicompress.models.loading import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from common import eval_windows, perplexity

    windows = eval_windows(tokenizer, n)
    theirs = client_load(out, dtype, loader).eval()
    client = perplexity(theirs, windows)
    del theirs
    ours = perplexity(load_model(out).model.float(), windows)
    return {"ppl_windows": n, "ppl_client": round(client, 4), "ppl_client_dtype": str(dtype).removeprefix("torch."),
            "ppl_ours": round(ours, 4), "ppl_rel_diff": round(client / ours - 1, 6)}


if __name__ == "__main__":
    sys.exit(main())
