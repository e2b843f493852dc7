"""Distill's streamed teacher (issue 15 item 6): the top-k cache built one decoder layer at a time vs
with the teacher loaded whole, on the same windows: equality of the caches, the teacher's held-out
perplexity, and each run's peak resident memory (/usr/bin/time -v) in its own process.

  python benchmarks/studies/stream/teacher_stream_bench.py --teacher smollm2-demo --modes memory,stream --name demo
  python benchmarks/studies/stream/teacher_stream_bench.py --teacher /work/synth8b-4l --modes stream --name synth8b_4l

Windows: the first `--windows` 512-token windows of ../shared/data/wikitext2-test.txt (benchmarks/
common.py) are the training windows, the next `--held-out` the held-out ones. Each mode runs as
`teacher_stream_bench.py worker ...` in a child process with its own cache root, so nothing is reused
between modes; the worker records the key's time, each decoder layer's time (streamed) and the pass's
time. Wall times mean something only inside a quiet window (`/work/logs/quiet.sh`); on random weights
(synth models) only memory and time do. Writes benchmarks/results/teacher_stream_bench_NAME.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))


class LayerClock:
    """A Progress that records when each step of each task ends (per-layer times of the streamed pass)."""

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}

    @contextmanager
    def task(self, description: str, total: int | None):
        marks = self.marks.setdefault(description, [time.perf_counter()])

        class _Task:
            def advance(self, n: int = 1, **fields: object) -> None:
                marks.append(time.perf_counter())

        yield _Task()

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def steps(self, description: str) -> list[float]:
        m = self.marks.get(description, [])
        return [round(b - a, 3) for a, b in zip(m, m[1:])]


def worker(args: argparse.Namespace) -> None:
    import torch
    from common import eval_windows

    from geminicompress.distill import streamed_teacher as ST
    from geminicompress.models.loading import load_model

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    root = Path(args.cache)
    clock = LayerClock()
    result: dict = {"mode": args.mode}
    if args.mode == "memory":
        from geminicompress.distill.stage import _teacher_ppl
        from geminicompress.distill.topk_cache import build_topk_cache, cache_key

        t0 = time.perf_counter()
        loaded = load_model(args.teacher)
        result["load_s"] = round(time.perf_counter() - t0, 3)
        windows = eval_windows(loaded.tokenizer, args.windows + args.held_out)
        train, held = windows[: args.windows], windows[args.windows :]
        t0 = time.perf_counter()
        result["key"] = cache_key(loaded.model, train, args.k)
        result["key_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        cache = build_topk_cache(loaded.model, train, args.k, cpu, root=root, progress=clock)
        result["teacher_ppl"] = _teacher_ppl(loaded.model, held, cpu)
        result["pass_s"] = round(time.perf_counter() - t0, 3)
    else:
        if args.spill:
            ST.SPILL_SHARE = 0.0  # force the activations into memory-mapped files
        t0 = time.perf_counter()
        ckpt = ST.open_teacher(args.teacher)
        from geminicompress.models.loading import load_tokenizer

        tokenizer = load_tokenizer(str(ckpt.path), False)
        result["load_s"] = round(time.perf_counter() - t0, 3)
        windows = eval_windows(tokenizer, args.windows + args.held_out)
        train, held = windows[: args.windows], windows[args.windows :]
        t0 = time.perf_counter()
        result["key"] = ST.lazy_key(ckpt, train, args.k)
        result["key_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        work = Path(tempfile.mkdtemp(dir=args.cache))
        cache, result["teacher_ppl"] = ST.build_streamed_topk_cache(ckpt, train, held, args.k, cpu, work_dir=work,
                                                                    root=root, progress=clock)
        result["pass_s"] = round(time.perf_counter() - t0, 3)  # includes the key again (computed inside)
        result["layer_s"] = clock.steps("teacher layers")
        result["spilled"] = ST.spill_needed(torch.cat([train, held]), ckpt.model.config.hidden_size)
    result["windows"], result["held_out"], result["seq_len"] = len(train), len(held), train.shape[1]
    result["cache"] = str(cache.path)
    Path(args.out).write_text(json.dumps(result, indent=1))


def compare(a: Path, b: Path) -> dict:
    """Cache b against cache a: values' largest difference, indices equal where a's values are not tied."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    va, vb = x["values"].float(), y["values"].float()
    gap = va[..., :-1] - va[..., 1:]  # (n, T, k-1): a's rank r to r+1 (float16 values)
    inf = torch.full_like(gap[..., :1], float("inf"))
    sure = (torch.cat([inf, gap], -1) > 1e-2) & (torch.cat([gap, inf], -1) > 1e-2)  # apart from both neighbours
    return {"values_max_abs_diff": float((va - vb).abs().max()),
            "indices_equal_fraction": float((x["indices"] == y["indices"]).float().mean()),
            "indices_equal_where_untied": bool((x["indices"][sure] == y["indices"][sure]).all()),
            "untied_fraction": float(sure.float().mean())}


def run_mode(args: argparse.Namespace, mode: str, spill: bool, work: Path) -> dict:
    tag = mode + ("-spill" if spill else "")
    out, log, cache = work / f"{tag}.json", work / f"{tag}.log", work / f"cache-{tag}"
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--mode", mode, "--teacher", args.teacher,
           "--windows", str(args.windows), "--held-out", str(args.held_out), "--k", str(args.k), "--out", str(out),
           "--cache", str(cache), "--threads", str(args.threads)] + (["--spill"] if spill else [])
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if rc != 0:
        raise SystemExit(f"{tag} failed (rc {rc}); see {log}:\n{text[-2000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    result = json.loads(out.read_text())
    result.update({"peak_rss_gib": round(int(m.group(1)) / 2**20, 3), "wall_s": round(wall, 1)})
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("action", nargs="?", default="bench", choices=["bench", "worker"])
    p.add_argument("--teacher", required=True)
    p.add_argument("--modes", default="memory,stream", help="memory, stream, stream-spill (comma separated)")
    p.add_argument("--mode", choices=["memory", "stream"])
    p.add_argument("--spill", action="store_true")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--held-out", type=int, default=8)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="demo")
    p.add_argument("--out")
    p.add_argument("--cache")
    p.add_argument("--work", default=None, help="folder for caches and logs (default: a temporary one)")
    args = p.parse_args()
    if args.action == "worker":
        return worker(args)
    from geminicompress.host.machine import machine, versions

    work = Path(args.work or tempfile.mkdtemp(prefix="teacher-stream-"))
    runs = {}
    for mode in args.modes.split(","):
        runs[mode] = run_mode(args, mode.removesuffix("-spill"), mode.endswith("-spill"), work)
        print(mode, {k: v for k, v in runs[mode].items() if k != "layer_s"}, flush=True)
    modes = list(runs)
    comparisons = {f"{m} vs {modes[0]}": {**compare(Path(runs[modes[0]]["cache"]), Path(runs[m]["cache"])),
                                          "same_key": runs[m]["key"] == runs[modes[0]]["key"]}
                   for m in modes[1:]}
    for k, v in comparisons.items():
        print(k, v)
    report = {"command": " ".join(sys.argv), "teacher": args.teacher, "k": args.k, "runs": runs,
              "comparisons": comparisons, "machine": machine(), "versions": versions(),
              "note": "wall/pass/layer times are benchmark figures only when run inside /work/logs/quiet.sh"}
    path = ROOT / "benchmarks" / "results" / f"teacher_stream_bench_{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
