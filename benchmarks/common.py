"""What every benchmark shares: paths, the one benchmark protocol, the llm-compressor venv, child runs.

The protocol (so that figures compare across issues): the demo model (SmolLM2-135M), perplexity on the
first 16,384 tokens of ../shared/data/wikitext2-test.txt in 512-token windows, calibration windows of
512 tokens drawn with a fixed seed from ../shared/data/enwiki-sample.txt. Perplexity is the package's
own (`geminicompress.eval.quality.perplexity.perplexity`), so benchmarks and `geminicompress eval` agree.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
LLMC_VENV = Path(os.environ.get("GC_LLMC_VENV", "/work/venvs/llmc"))
EVAL_TOKENS = 16384
SEQ_LEN = 512


def eval_windows(tokenizer, n: int | None = None, tokens: int = EVAL_TOKENS) -> torch.Tensor:
    """The perplexity windows: (32, 512) from the start of wikitext2-test.txt (the first `tokens` tokens), or the
    first n of them, framed as the tokenizer frames a text (its BOS first where it adds one: 511 text tokens a
    window then; data/windows.py), as `geminicompress eval` frames them."""
    from geminicompress.data.windows import pack_windows, text_prefix, tokenize

    ids = tokenize(tokenizer, (DATA / "wikitext2-test.txt").read_text(), tokens)
    return pack_windows(ids, SEQ_LEN, n, prefix=text_prefix(tokenizer))


def repair_teacher(name: str, threads: int, eval_tokens: int = EVAL_TOKENS):
    """What every student-repair benchmark starts with: torch on `threads` threads, the teacher loaded, the
    protocol's perplexity windows. Returns (teacher, tokenizer, eval windows)."""
    from geminicompress.models.loading import load_model

    torch.set_num_threads(threads)
    loaded = load_model(name)
    return loaded.model, loaded.tokenizer, eval_windows(loaded.tokenizer, tokens=eval_tokens)


def calibration_ids(tokenizer, n: int, seed: int = 0) -> torch.Tensor:
    """n calibration windows of 512 tokens from enwiki-sample.txt: the ids every method gets."""
    from geminicompress.data.windows import calibration_windows

    return calibration_windows(tokenizer, str(DATA / "enwiki-sample.txt"), n, SEQ_LEN, seed)


def parse_layers(text: str) -> list[int]:
    """'13-18' -> [13, ..., 18]; '0,5,7' -> [0, 5, 7]; spans and indices mix: '6-7,13-15'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def perplexity(model, windows: torch.Tensor) -> float:
    from geminicompress.eval.quality.perplexity import perplexity as ppl

    return ppl(model, windows, "cpu", batch_size=4)


@torch.no_grad()
def round_to_nearest(model, bits: int, group: int, sym: bool):
    """The RTN baseline: every decoder linear quantized to the nearest grid point in place; returns model."""
    from geminicompress.core.arch import arch_for, decoder_layers, get_module
    from geminicompress.core.grid import QuantSpec, rtn_quantize

    spec = QuantSpec(bits, group, sym)
    for layer in decoder_layers(model):
        for name in arch_for(model).linears:
            lin = get_module(layer, name)
            lin.weight.data.copy_(rtn_quantize(lin.weight.data, spec).dequantize())
    return model



def stage_context(model: Path, loaded, stage: dict, calib: torch.Tensor, work: Path, state_dir: Path | None):
    """A StageContext over `loaded` (models.loading.load_model of `model`) for a one-stage recipe whose calibration
    windows are exactly `calib` (n, T) (same ids for every row of a benchmark), working in a fresh `work`
    (a calibrated stage's resume state in `state_dir`, else under `work`)."""
    import shutil

    from geminicompress.runtime.pipeline import StageContext
    from geminicompress.host.progress import NullProgress
    from geminicompress.runtime.recipes.schema import Recipe

    data = str(DATA / "enwiki-sample.txt")
    recipe = Recipe(model=str(model), calibration={"data": data, "samples": calib.shape[0],
                                                           "seq_len": calib.shape[1]}, stages=[stage])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ctx = StageContext(loaded.model, loaded.tokenizer, loaded.source, recipe, NullProgress(), torch.device("cpu"),
                       work, state_dir or work / "state")
    ctx._calibration[(data, calib.shape[0], calib.shape[1], recipe.seed)] = calib
    return ctx

def ensure_llmc_venv() -> Path:
    """The llm-compressor venv's python: reused when present, else created with the local CPU torch wheel
    first (a plain install would pull a CUDA build), then llmcompressor, which pins its own transformers."""
    python = LLMC_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLMC_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "llmcompressor==0.14.*", "gguf"], check=True)
    return python


def run_child(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run cmd from the repository root; return (wall seconds, the child's own peak RSS in GiB, its output).
    The peak is taken through peak_rss.py (see there: a child's ru_maxrss includes this process's peak).
    Raises RuntimeError with the output's tail when it fails."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.NamedTemporaryFile("r") as rss:
        wrapped = [sys.executable, str(ROOT / "benchmarks" / "peak_rss.py"), rss.name, "--", *map(str, cmd)]
        code = subprocess.run(wrapped, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                              cwd=ROOT).returncode
        out.seek(0)
        text = out.read()
        kib = int(rss.read() or 0)
    if code != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} failed ({code}):\n{text[-3000:]}")
    return time.perf_counter() - t0, kib / 2**20, text


def time_us(fn, repeats: int) -> dict:
    """Wall time of `fn()` in microseconds over `repeats` runs after 3 untimed ones: median, p10, p90."""
    for _ in range(3):
        fn()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e6)
    t.sort()
    return {"median_us": round(statistics.median(t), 1), "p10_us": round(t[len(t) // 10], 1),
            "p90_us": round(t[(9 * len(t)) // 10], 1)}


def run_checkout(code: Path, args: list[str], log: Path | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, its output) of `python -m geminicompress ARGS` with the package at `code`
    (a checkout's folder) under `/usr/bin/time -v`, from /tmp; the output also goes to `log` when given.
    -P: `-m` would put the current directory first on sys.path, and a run from a checkout's root would import
    that checkout's package whatever PYTHONPATH says."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = ["/usr/bin/time", "-v", sys.executable, "-P", "-m", "geminicompress", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/tmp")
    wall = time.perf_counter() - t0
    if log is not None:
        log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed with {code}:\n{proc.stdout[-2000:]}")
    return wall, peak_rss(proc.stdout), proc.stdout


def peak_rss(time_output: str) -> int:
    """The peak resident set in bytes from `/usr/bin/time -v`'s output."""
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_output).group(1)) * 1024


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor where there is none."""
    import platform

    from geminicompress.kernels.cpu_vendor import cpu_field

    return cpu_field("model name") or platform.processor() or "unknown"
