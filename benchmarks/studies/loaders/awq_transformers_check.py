"""Does transformers (through GPTQModel's AWQ kernels) load our AWQ output and compute our logits?

Runs our side here (tiny Llama from tests/tiny.py, or --model DIR, quantized with --method awq), then
loads the written folder with plain `AutoModelForCausalLM.from_pretrained` in the GPTQModel venv
(/work/venvs/gptqmodel: transformers 5.24 + gptqmodel, CPU torch) and compares logits.

  python benchmarks/studies/loaders/awq_transformers_check.py [--model DIR] [--venv /work/venvs/gptqmodel]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

THEIRS = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
out = sys.argv[1]
ref = torch.load(out + "/check.pt")
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16, device_map="cpu").eval()
kinds = sorted({type(m).__module__ + "." + type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")})
with torch.no_grad():
    logits = model(ref["ids"]).logits.float()
diff = (logits - ref["logits"]).abs()
print(json.dumps({"kernels": kinds, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                  "logit_scale": float(ref["logits"].abs().mean()),
                  "argmax_agreement": float((logits.argmax(-1) == ref["logits"].argmax(-1)).float().mean())}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model to quantize (default: a tiny Llama built in-process)")
    ap.add_argument("--venv", default="/work/venvs/gptqmodel")
    ap.add_argument("--group-size", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    sys.path.insert(0, str(ROOT / "tests"))
    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import RunOptions, run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    work = Path(tempfile.mkdtemp(prefix="awq-check-"))
    model_dir = args.model
    if model_dir is None:
        from tiny import save_tiny

        model_dir = str(save_tiny(work / "tiny", "llama", intermediate_size=256))
    text = work / "text.txt"
    from pydoc_data.topics import topics

    text.write_text("\n\n".join(topics[k] for k in sorted(topics)[:30]))
    stage = {"type": "quantize", "method": "awq", "group_size": args.group_size}
    recipe = recipe_from_stage(model_dir, stage, {"data": str(text), "samples": 8, "seq_len": 64}, "check",
                               output={"dtype": "float16"})
    out = work / "awq"
    run_recipe(recipe, out, RunOptions(device=torch.device("cpu")))
    ours = load_model(str(out)).model.float()
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids).logits
    torch.save({"ids": ids, "logits": logits}, out / "check.pt")
    res = subprocess.run([f"{args.venv}/bin/python", "-c", THEIRS, str(out)], capture_output=True, text=True,
                         env={"GPTQMODEL_CPU_WORKERS": "2", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if res.returncode != 0:
        print(json.dumps({"ok": False, "error": res.stderr.strip().splitlines()[-5:]}, indent=2))
        sys.exit(1)
    print(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
