"""Reference run for benchmarks/reproduce/prune_bench.py: llm-compressor's SparseGPT on the same token ids.

Run with the llm-compressor venv's Python (it pins its own transformers):
  /work/venvs/llmc/bin/python benchmarks/reproduce/prune_llmc_ref.py --model DIR --ids ids.pt --sparsity 0.5 --out OUT

SparseGPTModifier with llm-compressor's defaults (block 128, dampening 0.01, unstructured "0:0" mask, or
--mask 2:4), targets Linear, lm_head ignored. Saves a dense checkpoint (exact zeros, no compression
config) that the caller evaluates with its own perplexity code. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch file with (n, T) calibration token ids")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--mask", default="0:0", help="mask_structure, e.g. 2:4")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from llmc_common import load, timed_oneshot
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier

    model, tok, data, ids = load(args.model, args.ids, args.threads)
    recipe = SparseGPTModifier(sparsity=args.sparsity, mask_structure=args.mask, block_size=128,
                               dampening_frac=0.01, targets=["Linear"], ignore=["re:.*lm_head"])
    seconds = timed_oneshot(model, data, ids, recipe)
    model.save_pretrained(args.out, save_compressed=False)
    tok.save_pretrained(args.out)
    config_path = Path(args.out) / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # dense weights with exact zeros: load as a plain checkpoint
    config_path.write_text(json.dumps(config, indent=2))
    linears = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    zeros = sum(int((w == 0).sum()) for w in linears) / sum(w.numel() for w in linears)
    print(json.dumps({"seconds": seconds, "sparsity": zeros}))


if __name__ == "__main__":
    main()
