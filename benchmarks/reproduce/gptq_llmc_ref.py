"""Reference run for benchmarks/reproduce/gptq_bench.py: llm-compressor's GPTQ on the same token ids.

Run with the llm-compressor venv's Python (it pins its own transformers):
  /work/venvs/llmc/bin/python benchmarks/reproduce/gptq_llmc_ref.py --model DIR --ids ids.pt --bits 4 --group-size -1 --out OUT

GPTQModifier with llm-compressor's defaults (block 128, dampening 0.01, actorder "static") on int
weights, symmetric, per channel (--group-size -1) or per group; lm_head ignored. Writes the compressed
(pack-quantized) checkpoint, which the caller evaluates with its own loader and perplexity code.
Prints one JSON line: {"seconds": oneshot wall time, ...}.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch file with (n, T) calibration token ids")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=-1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype the model is loaded in: llm-compressor calibrates in the model's dtype")
    args = ap.parse_args()
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmc_common import load, timed_oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    model, tok, data, ids = load(args.model, args.ids, args.threads, dtype=args.dtype)
    if args.group_size in (-1, 0):
        weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=True, strategy="channel")
    else:
        weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=True, strategy="group",
                                   group_size=args.group_size)
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head"])
    seconds = timed_oneshot(model, data, ids, recipe)
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
