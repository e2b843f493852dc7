"""Reference run for benchmarks/gptq_bench.py: llm-compressor's GPTQ on the same token ids.

Run with the llm-compressor venv's Python (it pins its own transformers):
  /work/venvs/llmc/bin/python benchmarks/gptq_llmc_ref.py --model DIR --ids ids.pt --bits 4 --group-size -1 --out OUT

GPTQModifier with llm-compressor's defaults (block 128, dampening 0.01, actorder "static") on int
weights, symmetric, per channel (--group-size -1) or per group; lm_head ignored. Writes the compressed
(pack-quantized) checkpoint, which the caller evaluates with its own loader and perplexity code.
Prints one JSON line: {"seconds": oneshot wall time, ...}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch file with (n, T) calibration token ids")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=-1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # llm-compressor 0.14 pins cached activations, which fails on a machine without an accelerator.
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, index: None

    ids = torch.load(args.ids)  # (n, T)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    if args.group_size in (-1, 0):
        weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=True, strategy="channel")
    else:
        weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=True, strategy="group",
                                   group_size=args.group_size)
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head"])
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
