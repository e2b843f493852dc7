"""AWQ on the demo model: ours (awq, awq+gptq) vs round-to-nearest vs llm-compressor's AWQ, one run.

Protocol (the project's one benchmark protocol): calibration = `--windows` windows of 512 tokens drawn
with seed 0 from enwiki-sample.txt; perplexity on the first 16,384 tokens of wikitext2-test.txt in 32
non-overlapping 512-token windows. Every model is evaluated with the same perplexity code below, on
what was written to disk (ours loaded back through our AWQ / dense loaders). llm-compressor runs in its
own venv (benchmarks/reproduce/awq_llmc_ref.py) on the very same token ids and writes a dense fake-quantized
checkpoint. Search time = wall time of the quantize stage (ours) / of `oneshot` (llm-compressor).

  python benchmarks/reproduce/awq_bench.py            # 32 windows, 4-bit g64 and 3-bit g64
  python benchmarks/reproduce/awq_bench.py --quick    # 2 layers, 4 windows: a smoke test

llm-compressor's outputs are cached by (token-id hash, bits, group size) under --cache, so a rerun of
this script reuses them; delete the cache to time them again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, RESULTS, ROOT, calibration_ids, ensure_llmc_venv, eval_windows, perplexity, round_to_nearest  # noqa: E402
from geminicompress.runtime.pipeline import RunOptions


def rtn_model(model_dir: Path, bits: int, group: int, layers: int | None):
    from geminicompress.models.loading import load_model

    model = truncate(load_model(str(model_dir)).model, layers)
    return round_to_nearest(model, bits, group, sym=False)  # AWQ's grid: asymmetric with zero points


def truncate(model, layers: int | None):
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model


def run_ours(model_dir: Path, method: str, bits: int, group: int, windows: int, out: Path, layers: int | None,
             search_windows: int) -> dict:
    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    fmt = "awq" if bits == 4 else "dense"
    stage = {"type": "quantize", "method": method, "bits": bits, "group_size": group, "format": fmt,
             "search_windows": search_windows}
    cal = {"data": str(DATA / "enwiki-sample.txt"), "samples": windows, "seq_len": 512}
    recipe = recipe_from_stage(str(model_dir), stage, cal, "awq_bench")
    loaded = load_model(str(model_dir))
    truncate(loaded.model, layers)
    t0 = time.perf_counter()
    report = run_recipe(recipe, out, RunOptions(force=True, device=torch.device("cpu")), loaded=loaded)
    wall = time.perf_counter() - t0
    back = load_model(str(out)).model
    return {"model": back, "search_s": report["stages"][0]["seconds"], "wall_s": wall, "format": fmt}


def run_llmc(model_dir: Path, ids_file: Path, key: str, bits: int, group: int, cache: Path, layers: int = 0) -> dict:
    out = cache / f"llmc-{key}-w{bits}g{group}-l{layers}"
    stamp = cache / f"llmc-{key}-w{bits}g{group}-l{layers}.json"
    if not (stamp.is_file() and stamp.read_text().strip() and (layers or (out / "config.json").is_file())):
        py = ensure_llmc_venv()
        cmd = [str(py), str(ROOT / "benchmarks" / "reproduce" / "awq_llmc_ref.py"), "--model", str(model_dir), "--ids", str(ids_file),
               "--bits", str(bits), "--group-size", str(group), "--out", str(out), "--layers", str(layers)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"llm-compressor failed: {res.stderr[-2000:]}")
        stamp.write_text(res.stdout.strip().splitlines()[-1])
    info = json.loads(stamp.read_text().strip().splitlines()[-1])
    if layers:
        return {"model": None, "search_s": info["seconds"]}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return {"model": model, "search_s": info["seconds"], "cached": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 calibration and 4 eval windows, 4-bit only, no reference")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--configs", default="4:64,3:64", help="bits:group_size list")
    ap.add_argument("--methods", default="awq,awq+gptq")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--search-windows", type=int, default=8, help="ours: windows for the scale-search error")
    ap.add_argument("--timing-layers", type=int, default=0,
                    help="instead of perplexity: time ours vs llm-compressor's AWQ on the first N layers only")
    ap.add_argument("--cache", default="/tmp/gc-awq-bench")
    ap.add_argument("--name", default="awq_bench")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import demo_dir, load_model

    model_dir = demo_dir()
    tok = load_model(str(model_dir)).tokenizer
    layers = 2 if args.quick else None
    n_cal = 4 if args.quick else args.windows
    configs = [(4, 64)] if args.quick else [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    eval_ids = eval_windows(tok, 4 if args.quick else None)
    ids = calibration_ids(tok, n_cal)
    key = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    ids_file = cache / f"ids-{key}.pt"
    if not ids_file.is_file():
        torch.save(ids, ids_file)

    meta = {"calibration_windows": n_cal, "calibration_hash": key, "eval_windows": int(eval_ids.shape[0]),
            "search_windows": args.search_windows, "quick": args.quick, "machine": machine(), "versions": versions(),
            "command": " ".join(sys.argv), "threads": torch.get_num_threads()}
    rows: list[dict] = []

    def save() -> None:
        print(json.dumps(rows[-1]), flush=True)
        if not args.quick:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str) + "\n")

    if args.timing_layers:
        for bits, group in configs:
            ours = run_ours(model_dir, "awq", bits, group, n_cal, cache / f"timing-{key}-w{bits}", args.timing_layers,
                            args.search_windows)
            rows.append({"config": f"w{bits}g{group}", "layers": args.timing_layers, "ours_awq_s": ours["search_s"]})
            save()
            ref = run_llmc(model_dir, ids_file, key, bits, group, cache, args.timing_layers)
            rows[-1]["llmc_awq_s"] = ref["search_s"]
            rows[-1]["ratio"] = ours["search_s"] / ref["search_s"]
            save()
        return
    fp = truncate(load_model(str(model_dir)).model, layers)
    rows.append({"config": "fp32", "method": "float", "ppl": perplexity(fp, eval_ids)})
    save()
    del fp
    for bits, group in configs:
        cfg = f"w{bits}g{group}"
        rows.append({"config": cfg, "method": "rtn (asym)", "ppl": perplexity(rtn_model(model_dir, bits, group, layers), eval_ids)})
        save()
        for method in args.methods.split(","):
            res = run_ours(model_dir, method, bits, group, n_cal, cache / f"ours-{key}-{method}-{cfg}", layers,
                           args.search_windows)
            rows.append({"config": cfg, "method": f"ours {method}", "format": res["format"],
                         "ppl": perplexity(res["model"], eval_ids), "search_s": res["search_s"]})
            save()
        if not (args.quick or args.no_ref):
            res = run_llmc(model_dir, ids_file, key, bits, group, cache)
            rows.append({"config": cfg, "method": "llm-compressor awq", "ppl": perplexity(res["model"], eval_ids),
                         "search_s": res["search_s"]})
            save()

    print(f"\n{'config':8} {'method':22} {'ppl':>8} {'search s':>9}")
    for r in rows:
        s = f"{r['search_s']:9.1f}" if "search_s" in r else " " * 9
        print(f"{r['config']:8} {r['method']:22} {r['ppl']:8.2f} {s}")


if __name__ == "__main__":
    main()
