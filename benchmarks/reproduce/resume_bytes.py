"""A streamed run killed with SIGKILL and rerun writes the bytes of an uninterrupted run (issue #28's bar).

Setup as the issue's: the demo model saved in bfloat16 as shards; streamed GPTQ / AWQ / SparseGPT with 16
calibration windows of 256 tokens and `--threads 2`. For each method: one uninterrupted run; then, for each
kill point (after the first, a middle and the last-but-one layer is finished: the resumed run then redoes the
layer being worked on), the same command is started, killed with SIGKILL once that many layers are recorded
in the resume state, and rerun. The rerun is given no `--threads` while a busy process keeps a core loaded
(the machine's load changed: the automatic choice would now be 1 thread), so it must take the interrupted
run's 2 from the resume state. Every output's tensors are hashed (benchmarks/move_hashes.py: name, dtype,
shape, bytes) and compared with the uninterrupted run's.

  python benchmarks/reproduce/resume_bytes.py --work /work/scratch/resume            # all three methods
  python benchmarks/reproduce/resume_bytes.py --work /work/scratch/resume --methods gptq --kills 2,15,28

Prints a table and writes benchmarks/results/resume_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from move_hashes import digest_output  # noqa: E402

CAL = ["--samples", "16", "--calib-seq-len", "256", "--data", str(ROOT.parent / "shared" / "data" / "enwiki-sample.txt")]
METHODS = {
    "gptq": ["quantize", "--method", "gptq", "--bits", "4", *CAL],
    "awq": ["quantize", "--method", "awq", "--n-grid", "5", *CAL],
    "sparsegpt": ["prune", "--method", "sparsegpt", "--sparsity", "0.5", *CAL],
}


def bf16_demo(path: Path) -> Path:
    """The demo model in bfloat16, sharded (~100 MB a shard): what the issue resumed."""
    if (path / "config.json").is_file():
        return path
    import torch

    from geminicompress.models.loading import load_model

    loaded = load_model("smollm2-demo")
    loaded.model.to(torch.bfloat16).save_pretrained(path, max_shard_size="100MB")
    loaded.tokenizer.save_pretrained(path)
    return path


def finished_layers(out: Path) -> int:
    progress = out.with_name(f".{out.name}.partial") / "state" / "stream" / "shards" / "progress.json"
    try:
        return sum(u.startswith("layer.") for u in json.loads(progress.read_text())["units"])
    except (OSError, ValueError, KeyError):
        return 0


def command(model: Path, args: list[str], out: Path, threads: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "geminicompress", args[0], str(model), *args[1:], "-o", str(out), "--stream", "-q"]
    return cmd + (["--threads", str(threads)] if threads else [])


def busy() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--methods", default="gptq,awq,sparsegpt")
    parser.add_argument("--kills", default="1,15,29", help="kill once this many layers are finished (30 layers)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = bf16_demo(args.work / "demo-bf16")
    rows = []
    for name in args.methods.split(","):
        straight = args.work / f"{name}-straight"
        if not (straight / "report.json").is_file():
            shutil.rmtree(straight, ignore_errors=True)
            subprocess.run(command(model, METHODS[name], straight, 2), check=True, cwd=ROOT)
        reference = digest_output(straight)
        for k in (int(x) for x in args.kills.split(",")):
            out = args.work / f"{name}-killed-{k}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(f".{out.name}.partial"), ignore_errors=True)
            proc = subprocess.Popen(command(model, METHODS[name], out, 2), cwd=ROOT)
            while finished_layers(out) < k and proc.poll() is None:
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            at = finished_layers(out)
            burner = multiprocessing.Process(target=busy, daemon=True)  # the machine's load changed
            burner.start()
            try:
                rerun = subprocess.run(command(model, METHODS[name], out, None), cwd=ROOT, capture_output=True, text=True)
            finally:
                burner.terminate()
            report = json.loads((out / "report.json").read_text()) if rerun.returncode == 0 else {}
            row = {"method": name, "killed_after_layers": at, "rerun_exit": rerun.returncode,
                   "rerun_threads": report.get("threads"), "hash": digest_output(out) if rerun.returncode == 0 else None,
                   "uninterrupted_hash": reference}
            row["equal"] = row["hash"] == reference
            rows.append(row)
            print(f"{name:10s} killed after {at:2d} layers: rerun exit {rerun.returncode}, threads "
                  f"{row['rerun_threads']}, bytes {'EQUAL' if row['equal'] else 'DIFFER'}", flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results = ROOT / "benchmarks" / "results" / "resume_bytes.json"
    results.write_text(json.dumps({"commit": commit, "model": "smollm2-demo in bfloat16, 100 MB shards",
                                   "command": METHODS, "rows": rows}, indent=1) + "\n")
    print(f"{sum(r['equal'] for r in rows)}/{len(rows)} resumed runs equal their uninterrupted run")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
