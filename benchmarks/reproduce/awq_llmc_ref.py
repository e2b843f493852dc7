"""Reference run for benchmarks/reproduce/awq_bench.py: llm-compressor's AWQ on the same token ids.

Run with the llm-compressor venv's Python (it is not importable from geminicompress's environment):
  /work/venvs/llmc/bin/python benchmarks/reproduce/awq_llmc_ref.py --model DIR --ids ids.pt --bits 4 --group-size 64 --out OUT

Applies AWQModifier (llm-compressor's defaults: duo scaling, 20-point grid, no clipping) followed by
QuantizationModifier (asymmetric int weights, per group), then writes a *dense* checkpoint whose linear
weights are llm-compressor's fake-quantized weights, so that the caller evaluates it with its own
perplexity code. Prints one JSON line: {"seconds": oneshot wall time, ...}.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="torch file with (n, T) calibration token ids")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (timing runs)")
    args = ap.parse_args()
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, forward_quantize
    from llmc_common import load, timed_oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM

    model, tok, data, ids = load(args.model, args.ids, args.threads, args.layers)
    weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=False, strategy="group",
                               group_size=args.group_size)
    recipe = [
        AWQModifier(),
        QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                             ignore=["lm_head"]),
    ]
    seconds = timed_oneshot(model, data, ids, recipe)

    state = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and scheme.weights is not None and hasattr(module, "weight_scale"):
                state[f"{name}.weight"] = forward_quantize(module, module.weight, "weight", scheme.weights).clone()
    if args.layers:  # a timing run: nothing to evaluate
        print(json.dumps({"seconds": seconds, "quantized_linears": len(state), "layers": args.layers}))
        return
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ours = plain.state_dict()
    theirs = model.state_dict()
    merged = {k: state.get(k, theirs.get(k, v)).to(v.dtype) for k, v in ours.items()}
    plain.load_state_dict(merged)
    plain.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(json.dumps({"seconds": seconds, "quantized_linears": len(state)}))


if __name__ == "__main__":
    main()
