"""Score one GGUF in llama.cpp on the first 8,192 WikiText-2 tokens (16 x 512), perplexity only: python benchmarks/studies/gguf/gguf_score_one.py FILE.gguf
(threads: GEMINICOMPRESS_LLAMA_THREADS, default 2)"""
import json, sys, time
from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[2])); sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from common import eval_windows

from geminicompress.eval.engines.llama_eval import quality_from_llama, run_driver
from geminicompress.models.loading import load_model

w = eval_windows(load_model("smollm2-demo").tokenizer, 16)
t0 = time.time()
r = run_driver(__import__("os").environ.get("GEMINICOMPRESS_LLAMA_PYTHON", "/work/venv-llama/bin/python"), {"model": sys.argv[1], "threads": int(__import__("os").environ.get("GEMINICOMPRESS_LLAMA_THREADS", "2")), "n_ctx": 528,
               "tasks": [{"kind": "logprobs", "windows": w.tolist(), "top_k": 0, "at": None}]})
print(json.dumps({"file": sys.argv[1], "error": r.get("error"), "quality": quality_from_llama(r["tasks"][0], w, None) if not r.get("error") else None, "s": round(time.time()-t0)}))
