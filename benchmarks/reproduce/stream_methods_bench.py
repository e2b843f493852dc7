"""Streamed against in-memory on the demo model, for every method streaming covers (issue 15's bars):
the outputs tensor by tensor (bitwise), perplexity under the project protocol where they differ, and,
with --time, whole-process wall time and peak memory of the two paths run alternately.

  python benchmarks/reproduce/stream_methods_bench.py --work SCRATCH                 # equality (+ perplexity)
  /work/logs/quiet.sh python benchmarks/reproduce/stream_methods_bench.py --work SCRATCH --time wanda --repeats 2

Each run is `python -m geminicompress CMD smollm2-demo -o OUT --stream|--no-stream ARGS` (the demo's
converted float32 directory: both paths write float32). Calibrated methods use 32 windows of 512 tokens
of ../shared/data/enwiki-sample.txt. Perplexity: benchmarks/common.py (first 16,384 tokens of
wikitext2-test.txt in 512-token windows). Timing (--time) only means something with every other process
paused (/work/logs/quiet.sh); it alternates streamed and in-memory runs (S M S M ...), records each
whole-process wall time and peak RSS (/usr/bin/time -v) and their medians; a later --time of the same
name adds its runs to the earlier ones (a method too slow for one quiet window takes several).
Writes benchmarks/results/stream_methods_demo.json (equality) or stream_methods_timing.json (timing),
merging with what is there.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, RESULTS, ROOT, eval_windows, perplexity  # noqa: E402

CAL = ["--samples", "32", "--calib-seq-len", "512", "--data", str(DATA / "enwiki-sample.txt")]
RUNS: dict[str, list[str]] = {
    "wanda": ["prune", "--method", "wanda", "--sparsity", "0.5", *CAL],
    "sparsegpt": ["prune", "--method", "sparsegpt", "--sparsity", "0.5", *CAL],
    "sparsegpt_24_ct": ["prune", "--method", "sparsegpt", "--pattern", "2:4", "--format", "compressed-tensors", *CAL],
    "w8a8_smoothquant": ["quantize", "--method", "w8a8", *CAL],
    "awq": ["quantize", "--method", "awq", "--bits", "4", "--group-size", "64", *CAL],
    "awq_gptq": ["quantize", "--method", "awq+gptq", "--bits", "4", "--group-size", "64", *CAL],
    "gptq_ct": ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "64", "--format", "compressed-tensors", *CAL],
    "rtn": ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "64"],
    "chain_sparsegpt_gptq": ["run", "RECIPE"],
    # cheaper AWQ settings for timing only (a full AWQ run of the demo takes ~4 min, two of them fill a quiet
    # window): the streamed path's extra cost is per layer, so a shorter run makes the ratio conservative
    "awq_t": ["quantize", "--method", "awq", "--bits", "4", "--group-size", "64", "--n-grid", "5",
              "--samples", "16", *CAL[2:]],
    "awq_gptq_t": ["quantize", "--method", "awq+gptq", "--bits", "4", "--group-size", "64", "--n-grid", "5",
                   "--samples", "16", *CAL[2:]],
}
CHAIN = f"""\
model: smollm2-demo
calibration: {{data: {DATA / 'enwiki-sample.txt'}, samples: 32, seq_len: 512}}
stages:
  - {{type: prune, method: sparsegpt, sparsity: 0.5}}
  - {{type: quantize, method: gptq, bits: 4, group_size: 64}}
"""


def command(name: str, out: Path, stream: bool, work: Path, extra: list[str]) -> list[str]:
    cmd, *args = RUNS[name]
    if cmd == "run":
        recipe = work / "chain.yaml"
        recipe.write_text(CHAIN)
        head = ["run", str(recipe)]
    else:
        head = [cmd, "smollm2-demo", *args]
    return [sys.executable, "-m", "geminicompress", *head, "-o", str(out), "--force", "-q",
            "--stream" if stream else "--no-stream", *extra]


def timed(cmd: list[str], log: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd` under /usr/bin/time -v; fails loudly on a non-zero exit."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}): see {log}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())
    return wall, int(m.group(1)) * 1024 if m else -1


def compare(a: Path, b: Path) -> dict:
    """Tensors of two checkpoints: how many are bitwise equal, the largest difference of the others."""
    import torch

    from geminicompress.formats.checkpoint import read_tensors

    ta, tb = read_tensors(a), read_tensors(b)
    same = [k for k in ta if k in tb and ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
            and torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))]
    differ = sorted(set(ta) - set(same))
    largest = max((float((ta[k].float() - tb[k].float()).abs().max()) for k in differ
                   if k in tb and ta[k].shape == tb[k].shape), default=0.0)
    configs = all(json.loads((a / f).read_text()) == json.loads((b / f).read_text())
                  for f in ("config.json", "quantize_config.json") if (a / f).is_file())
    return {"tensors": len(ta), "bitwise_equal": len(same), "differ": differ[:5], "n_differ": len(differ),
            "max_abs_diff": largest, "configs_equal": configs, "same_names": set(ta) == set(tb)}


def ppl(out: Path) -> float:
    import torch

    from geminicompress.models.loading import load_model

    loaded = load_model(str(out), dtype=torch.float32)
    return perplexity(loaded.model, eval_windows(loaded.tokenizer))


def equality(names: list[str], work: Path, always_ppl: bool) -> dict:
    rows = {}
    for name in names:
        outs = {}
        for stream in (True, False):
            out = outs[stream] = work / f"{name}-{'stream' if stream else 'memory'}"
            wall, rss = timed(command(name, out, stream, work, []), work / f"{out.name}.log")
            print(f"{out.name}: {wall:.0f} s (shared machine), peak {rss / 2**20:.0f} MiB", flush=True)
        row = compare(outs[True], outs[False])
        if always_ppl or row["n_differ"]:
            row["ppl_stream"], row["ppl_memory"] = ppl(outs[True]), ppl(outs[False])
            row["ppl_equal_4_digits"] = f"{row['ppl_stream']:.4g}" == f"{row['ppl_memory']:.4g}"
        row["command"] = " ".join(command(name, Path("OUT"), True, work, [])[1:])
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    return rows


def timing(names: list[str], work: Path, repeats: int, before: dict) -> dict:
    """S M S M ... per name; the runs add to those `before` holds for it (several quiet windows)."""
    rows = {}
    for name in names:
        old = before.get(name, {})
        runs = {m: [(w, p * 2**20) for w, p in zip(old.get("wall_s", {}).get(m, []), old.get("peak_mib_each", {}).get(m, []))]
                for m in ("stream", "memory")}
        for r in range(repeats):
            for mode in ("stream", "memory"):
                out = work / f"{name}-{mode}-t"
                runs[mode].append(timed(command(name, out, mode == "stream", work, ["--threads", "2"]),
                                        work / f"{out.name}{r}.log"))
        med = {m: statistics.median(w for w, _ in v) for m, v in runs.items()}
        rows[name] = {"runs": len(runs["stream"]), "wall_s": {m: [round(w, 2) for w, _ in v] for m, v in runs.items()},
                      "median_s": {m: round(w, 2) for m, w in med.items()},
                      "ratio": round(med["stream"] / med["memory"], 3),
                      "peak_mib_each": {m: [round(p / 2**20) for _, p in v] for m, v in runs.items()},
                      "peak_mib": {m: round(statistics.median(p for _, p in v) / 2**20) for m, v in runs.items()},
                      "command": " ".join(command(name, Path("OUT"), True, work, ["--threads", "2"])[1:])}
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--only", default=",".join(RUNS), help="comma-separated names (default: all)")
    ap.add_argument("--time", action="store_true", help="time the two paths (run it under /work/logs/quiet.sh)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ppl", action="store_true", help="perplexity even where the tensors are equal")
    a = ap.parse_args()
    names = a.only.split(",")
    a.work.mkdir(parents=True, exist_ok=True)
    dest = RESULTS / ("stream_methods_timing.json" if a.time else "stream_methods_demo.json")
    result = json.loads(dest.read_text()) if dest.is_file() else {"runs": {}}
    rows = timing(names, a.work, a.repeats, result["runs"]) if a.time else equality(names, a.work, a.ppl)
    from geminicompress.host.machine import machine, versions

    result["runs"].update(rows)
    result.update({"machine": machine(), "versions": versions(),
                   "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=ROOT).stdout.strip()})
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
