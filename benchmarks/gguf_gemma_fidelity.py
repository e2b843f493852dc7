"""Gemma 3 270M at Q4_0: which file stays closer to the float model, and why perplexity says otherwise.

Every GGUF file's weights (its decoder linears and token embeddings, dequantized by the `gguf` package) are
put into the float model (/work/gemma3-270m, transformers' reading of the shipped Q4_K_M file) and scored
in torch on the first `--tokens` (4,096) WikiText-2 test tokens in 512-token windows (no BOS, the project's
protocol), against the float model's own logits on the same windows:
- perplexity, exact KL(float || file) over the whole 262k vocabulary, top-1 agreement, mean entropy of the
  predicted distribution;
- the perplexity at the best temperature (logits / T, T on a grid; the same T for every token): a model
  that is merely over- or under-confident on this text gains here, one that lost information does not;
- with `--swap KIND` (a GGUF tensor kind: attn_v, attn_k, ...): the float model (or, with `--swap-base LABEL`,
  the model with that file's weights) with only that kind of tensor taken from each other file, to see what one
  kind of quantization error does to perplexity and KL.

    python benchmarks/gguf_gemma_fidelity.py --files llama-imatrix=/tmp/b/llama-q4_0-imatrix.gguf,\
ours=/tmp/g/def/model.gguf --swap attn_v

No timings. The files: `benchmarks/gguf_gemma_bench.py` makes llama.cpp's (from our F32 export, with and
without an importance matrix); ours is `quantize /work/gemma3-270m --method gptq --format gguf` (defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, eval_windows  # noqa: E402

MODEL = "/work/gemma3-270m"
# GGUF tensor kind -> the module inside a Gemma 3 decoder layer (gemma3: no Q/K row reordering)
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
TEMPERATURES = [round(0.8 + 0.05 * i, 2) for i in range(21)]  # 0.8 .. 1.8


def file_weights(path: Path) -> dict[str, torch.Tensor]:
    """{parameter name of the transformers model: dequantized float32 tensor} for the file's decoder linears
    and token embeddings."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif parts[0] == "blk" and parts[2] in LINEARS:
            name = f"model.layers.{parts[1]}.{LINEARS[parts[2]]}.weight"
        else:
            continue
        out[name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    return out


def kind_of(name: str) -> str:
    return next((k for k, m in LINEARS.items() if f".{m}." in name), "token_embd")


@torch.no_grad()
def log_probs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per window, log-probabilities (T - 1, vocab) of every next token."""
    return [F.log_softmax(model(w[None]).logits[0, :-1].float(), -1) for w in windows]


def scores(lp: list[torch.Tensor], ref: list[torch.Tensor], windows: torch.Tensor) -> dict:
    nll = kl = agree = entropy = 0.0
    n = 0
    by_t = {t: 0.0 for t in TEMPERATURES}
    for p, r, w in zip(lp, ref, windows):
        target = w[1:, None]
        nll -= float(p.gather(1, target).sum())
        kl += float((r.exp() * (r - p)).sum())
        agree += float((r.argmax(-1) == p.argmax(-1)).sum())
        entropy -= float((p.exp() * p).sum())
        for t in TEMPERATURES:
            by_t[t] -= float(F.log_softmax(p / t, -1).gather(1, target).sum())
        n += target.shape[0]
    best = min(by_t, key=by_t.get)
    return {"perplexity": round(math.exp(nll / n), 4), "kl_to_float": round(kl / n, 5),
            "top1_agreement": round(agree / n, 4), "entropy": round(entropy / n, 4), "mean_nll": round(nll / n, 4),
            "best_temperature": best, "perplexity_at_best_temperature": round(math.exp(by_t[best] / n), 4),
            "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", required=True, help="name=path.gguf,... (Gemma 3 270M files)")
    ap.add_argument("--swap", default="", help="comma separated GGUF tensor kinds (attn_v, attn_k, ...): also score "
                    "the float model with only that kind taken from each file")
    ap.add_argument("--swap-base", default="float", help="what the --swap rows start from: float, or the label of "
                    "one of --files (given first in --files)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="gguf_gemma_fidelity")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.machine import machine, versions
    from geminicompress.models.loading import load_model

    loaded = load_model(MODEL)
    model, windows = loaded.model, eval_windows(loaded.tokenizer, tokens=args.tokens)
    params = dict(model.named_parameters())
    floats = {name: p.detach().clone() for name, p in params.items()}
    ref = log_probs(model, windows)
    out = {"benchmark": "Gemma 3 270M Q4_0 files: fidelity to the float model (torch)", "model": MODEL,
           "perplexity": f"wikitext2-test.txt, first {args.tokens} tokens, 512-token windows, no BOS",
           "temperatures": TEMPERATURES, "machine": machine(), "versions": versions(),
           "command": "python benchmarks/gguf_gemma_fidelity.py " + " ".join(sys.argv[1:]),
           "files": {}, "rows": {"float": scores(ref, ref, windows)}}
    print(f"float: {out['rows']['float']}", flush=True)
    base: dict[str, torch.Tensor] = floats
    for spec in args.files.split(","):
        label, path = spec.split("=", 1)
        weights = file_weights(Path(path))
        out["files"][label] = path
        swaps = [] if label == args.swap_base else [
            (f"{args.swap_base} + {label}'s {k}", {n for n in weights if kind_of(n) == k})
            for k in filter(None, args.swap.split(","))]
        for row, names in [(label, set(weights)), *swaps]:
            start = floats if row == label else base
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name].view_as(p) if name in names else start[name])
            out["rows"][row] = scores(log_probs(model, windows), ref, windows)
            print(f"{row}: {out['rows'][row]}", flush=True)
            (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
        if label == args.swap_base:
            base = {**floats, **{n: w.view_as(params[n]) for n, w in weights.items()}}
    print(f"\n| row | perplexity | KL to float | top-1 | entropy | best T | perplexity at best T |\n|---|---|---|---|---|---|---|")
    for row, s in out["rows"].items():
        print(f"| {row} | {s['perplexity']} | {s['kl_to_float']} | {s['top1_agreement']:.1%} | {s['entropy']} | "
              f"{s['best_temperature']} | {s['perplexity_at_best_temperature']} |")


if __name__ == "__main__":
    main()
