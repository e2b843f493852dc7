"""The bars of `--format gguf` on a real model, checked by an independent llama.cpp client (issue #37).

    python benchmarks/studies/gguf/gguf_export_check.py OUT [--float-dir DIR] [--tokens 8192] [--llama-python PY]

For OUT (written by `quantize ... --format gguf`):
- llama.cpp loads OUT/model.gguf; its perplexity on the first N WikiText-2 test tokens (tokenized by the
  transformers tokenizer, fed as ids, non-overlapping 512-token windows, the same NLL as eval/quality/perplexity.py)
  against our torch perplexity of OUT's checkpoint on the same windows (bar: within 1%);
- with --float-dir (the float model as a transformers directory, e.g. the demo's converted copy): its F32
  export, with the tokenizer metadata *built* from that directory's tokenizer.json, scored by llama.cpp against
  our float32 eval (bar: equal to 4 decimals), and llama.cpp's tokenization of the evaluation text with that
  metadata against the transformers ids (bar: equal).
llama.cpp runs in another python (llama-cpp-python: /work/venv-llama/bin/python or --llama-python) through a
subprocess; the figures go to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from geminicompress.eval.quality.perplexity import perplexity
from geminicompress.formats.gguf_export import GGUFOptions, export
from geminicompress.models.loading import load_model

DATA = Path(__file__).resolve().parents[4] / "shared" / "data" / "wikitext2-test.txt"
CTX = 512

LLAMA_SIDE = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(open(sys.argv[1]).read())
llm = Llama(job["path"], logits_all=True, n_ctx=job["ctx"], n_batch=job["ctx"], verbose=False)
nll, n = 0.0, 0
for w in job["windows"]:
    llm.reset()
    llm.eval(w)
    logits = np.asarray(llm.scores[:len(w) - 1], dtype=np.float64)  # (T-1, V): position t predicts w[t+1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    nll -= logp[np.arange(len(w) - 1), w[1:]].sum()
    n += len(w) - 1
out = {"ppl": math.exp(nll / n), "scored": n}
if job.get("text") is not None:
    ids = llm.tokenize(job["text"].encode(), add_bos=False, special=False)
    out["tokens_equal"] = ids == job["ids"]
    out["tokens"] = len(ids)
    if not out["tokens_equal"]:
        first = next((i for i, (a, b) in enumerate(zip(ids, job["ids"])) if a != b), min(len(ids), len(job["ids"])))
        out["first_difference"] = first
print(json.dumps(out))
"""


def windows_of(tok, tokens: int) -> tuple[torch.Tensor, str]:
    """The first `tokens` tokens of WikiText-2 test as (n, 512) windows, and the text they come from."""
    text = DATA.read_text()
    chars = len(text)
    for cut in (200_000, 400_000, chars):  # tokenize a prefix that is long enough
        ids = tok(text[:cut], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens + 1 or cut == chars:
            break
    ids = torch.tensor(ids[:tokens])
    return ids.view(-1, CTX), text[:cut]


def llama_ppl(python: str, path: Path, windows: torch.Tensor, text: str | None = None,
              ids: list[int] | None = None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"path": str(path), "ctx": CTX, "windows": windows.tolist(), "text": text, "ids": ids}, f)
    res = subprocess.run([python, "-c", LLAMA_SIDE, f.name], capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    if res.returncode != 0:
        raise SystemExit(f"llama.cpp failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--float-dir", type=Path)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--llama-python", default="/work/venv-llama/bin/python")
    args = ap.parse_args()
    result: dict = {"tokens": args.tokens, "ctx": CTX}
    loaded = load_model(str(args.out))
    windows, _ = windows_of(loaded.tokenizer, args.tokens)
    ours = perplexity(loaded.model, windows)
    theirs = llama_ppl(args.llama_python, args.out / "model.gguf", windows)
    result["quantized"] = {"torch": ours, "llama_cpp": theirs["ppl"], "drift_pct": 100 * (theirs["ppl"] / ours - 1)}
    del loaded
    if args.float_dir is not None:
        floats = load_model(str(args.float_dir))
        windows, text = windows_of(floats.tokenizer, args.tokens)
        ids = floats.tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = perplexity(floats.model, windows)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "f32.gguf"
            info = export(args.float_dir, GGUFOptions(embeddings="f32", floats="f32"), dest=path)
            theirs = llama_ppl(args.llama_python, path, windows, text, ids)
        result["f32"] = {"torch": ours, "llama_cpp": theirs["ppl"], "abs_diff": abs(ours - theirs["ppl"]),
                         "equal_4_decimals": round(ours, 4) == round(theirs["ppl"], 4),
                         "tokenizer": info["tokenizer"], "tokens_equal": theirs["tokens_equal"],
                         "tokenized": theirs["tokens"], **({"first_difference": theirs["first_difference"]}
                                                           if "first_difference" in theirs else {})}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
