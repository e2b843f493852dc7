"""Reference run for benchmarks/awq_bench.py: llm-compressor's AWQ on the same token ids.

Run with the llm-compressor venv's Python (it is not importable from geminicompress's environment):
  /work/venvs/llmc/bin/python benchmarks/awq_llmc_ref.py --model DIR --ids ids.pt --bits 4 --group-size 64 --out OUT

Applies AWQModifier (llm-compressor's defaults: duo scaling, 20-point grid, no clipping) followed by
QuantizationModifier (asymmetric int weights, per group), then writes a *dense* checkpoint whose linear
weights are llm-compressor's fake-quantized weights, so that the caller evaluates it with its own
perplexity code. Prints one JSON line: {"seconds": oneshot wall time, ...}.
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
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (timing runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor.pipelines.cache import IntermediatesCache

    # llm-compressor 0.14 pins cached activations, which fails on a machine without an accelerator.
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, index: None

    ids = torch.load(args.ids)  # (n, T)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    tok = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=False, strategy="group",
                               group_size=args.group_size)
    recipe = [
        AWQModifier(),
        QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                             ignore=["lm_head"]),
    ]
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0

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
