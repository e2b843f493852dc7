"""Real-client check: transformers' `from_pretrained(OUT)` (through GPTQModel) loads our `gptq` output
and gives the same logits as geminicompress's own loader.

Needs gptqmodel next to transformers. A plain `pip install gptqmodel` pulls CUDA torch; instead
(the command this check was run with):
  python -m venv --system-site-packages /work/venvs/gptqmodel
  /work/venvs/gptqmodel/bin/pip install --no-deps gptqmodel pypcre logbar tokenicer device-smi defuser threadpoolctl
  GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqmodel/bin/python benchmarks/gptq_client_check.py OUT [OUT ...]
Prints one JSON line per checkpoint: max |Δlogit|, relative error, argmax agreement, kernel used.
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
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    torch.set_num_threads(args.threads)
    import gptqmodel
    import transformers
    from transformers import AutoModelForCausalLM

    from geminicompress.models.loading import load_model

    failed = False
    for out in args.outs:
        ours = load_model(out)
        ids = torch.randint(0, ours.model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu")
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
        failed |= not kernels or result["rel_error"] > 1e-2
        print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
