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

    python benchmarks/studies/gguf/gguf_gemma_fidelity.py --files llama-imatrix=/tmp/b/llama-q4_0-imatrix.gguf,\
ours=/tmp/g/def/model.gguf --swap attn_v

No timings. The files: `benchmarks/reproduce/gguf_gemma_bench.py` makes llama.cpp's (from our F32 export, with and
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
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
def scores(model, windows: torch.Tensor, cache, *, store: bool = False) -> dict:
    """The model's figures on `windows` against the float model's log-probs in `cache` (a BaselineCache;
    with `store`, the model is the float one and its log-probs are put there), one chunk of positions at a
    time as `eval` scores them (models/head.window_chunks)."""
    from geminicompress.core.metrics import DriftMeter
    from geminicompress.eval.quality.perplexity import PerplexityMeter, token_nll
    from geminicompress.models.head import window_chunks

    ppl, drift, by_t = PerplexityMeter(), DriftMeter(), {t: PerplexityMeter() for t in TEMPERATURES}
    entropy = 0.0
    for i, window in enumerate(windows):
        start = 0
        for logp in window_chunks(model, window, torch.device("cpu")):  # (c, V)
            stop, first = start + logp.shape[0], start == 0
            if store:
                cache.put(i, start, logp)
            ppl.add(token_nll(logp, window, start), window=first)
            drift.add(logp if store else cache.get(i, window, start, stop), logp)
            entropy -= float((logp.exp() * logp).double().sum())
            for t, meter in by_t.items():
                meter.add(token_nll(F.log_softmax(logp / t, -1), window, start), window=first)
            start = stop
    best = min(by_t, key=lambda t: by_t[t].mean_nll)
    return {"perplexity": round(ppl.perplexity, 4), "kl_to_float": round(drift.kl, 5),
            "top1_agreement": round(drift.agreement, 4), "entropy": round(entropy / ppl.tokens, 4),
            "mean_nll": round(ppl.mean_nll, 4), "best_temperature": best,
            "perplexity_at_best_temperature": round(by_t[best].perplexity, 4), "tokens": ppl.tokens}


def run(args: argparse.Namespace, files: list[list[str]], model, windows: torch.Tensor, cache) -> dict:
    """Every row: the float model, each file, and the --swap rows; the JSON written after each."""
    from geminicompress.host.machine import machine, versions

    params = dict(model.named_parameters())
    floats = {name: p.detach().clone() for name, p in params.items()}
    out = {"benchmark": "Gemma 3 270M Q4_0 files: fidelity to the float model (torch)", "model": MODEL,
           "perplexity": f"wikitext2-test.txt, first {args.tokens} tokens, 512-token windows, no BOS",
           "temperatures": TEMPERATURES, "machine": machine(), "versions": versions(),
           "command": "python benchmarks/studies/gguf/gguf_gemma_fidelity.py " + " ".join(sys.argv[1:]),
           "files": {}, "rows": {"float": scores(model, windows, cache, store=True)}}
    print(f"float: {out['rows']['float']}", flush=True)
    base: dict[str, torch.Tensor] = floats
    for label, path in files:
        weights = file_weights(Path(path))
        out["files"][label] = path
        swaps = [] if label == args.swap_base else [
            (f"{args.swap_base} + {label}'s {k}", {name for name in weights if kind_of(name) == k})
            for k in filter(None, args.swap.split(","))]
        for row, names in [(label, set(weights)), *swaps]:
            start = floats if row == label else base
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name].view_as(p) if name in names else start[name])
            out["rows"][row] = scores(model, windows, cache)
            print(f"{row}: {out['rows'][row]}", flush=True)
            (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
        if label == args.swap_base:
            base = {**floats, **{name: w.view_as(params[name]) for name, w in weights.items()}}
    return out


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
    files = [spec.split("=", 1) for spec in args.files.split(",")]
    if any(len(f) != 2 or not f[0] or not Path(f[1]).is_file() for f in files):
        ap.error("--files takes name=path.gguf,... with every path an existing file")
    if args.swap_base not in ("float", files[0][0]):
        ap.error(f"--swap-base {args.swap_base}: give that label first in --files (or use float)")
    torch.set_num_threads(args.threads)
    from geminicompress.eval.quality.baseline_cache import BaselineCache
    from geminicompress.models.loading import load_model

    loaded = load_model(MODEL)
    model, windows = loaded.model, eval_windows(loaded.tokenizer, tokens=args.tokens)
    count, scored, vocab = windows.shape[0], windows.shape[1] - 1, model.config.vocab_size
    # the float model's log-probs on disk: the model object is reused for every file, so it cannot recompute them
    with BaselineCache(count, scored, vocab, limit_bytes=count * scored * vocab * 4) as cache:
        if not cache.stored:
            raise SystemExit(f"not enough free disk under {cache.dir.parent} for the float model's log-probs")
        out = run(args, files, model, windows, cache)
    print("\n| row | perplexity | KL to float | top-1 | entropy | best T | perplexity at best T |\n|---|---|---|---|---|---|---|")
    for row, s in out["rows"].items():
        print(f"| {row} | {s['perplexity']} | {s['kl_to_float']} | {s['top1_agreement']:.1%} | {s['entropy']} | "
              f"{s['best_temperature']} | {s['perplexity_at_best_temperature']} |")


if __name__ == "__main__":
    main()
