"""Which python runs an engine that lives in its own venv (vLLM, llama.cpp), and how a job is handed to its
driver script there: one rule for both."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from geminicompress.core.errors import GeminiError, InputError


def engine_python(given: str | None, env: str, module: str, flag: str, needs: str, install: str) -> str:
    """`flag`'s value, else $`env`, else this python if it imports `module`; InputError (exit 2) naming the
    install command otherwise. `needs`: the sentence start, e.g. "--engine vllm needs vLLM"."""
    python = given or os.environ.get(env)
    if python:
        if not Path(python).is_file():
            raise InputError(f"{flag} {python} does not exist: {install}")
        return python
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    raise InputError(f"{needs}, which this python does not have: {install}")


def run_job(python: str, driver: Path, job: dict, name: str, env: dict | None = None) -> tuple[dict, str]:
    """Run `driver` under `python` on `job` (JSON in, JSON out); return its result and its output. The output
    goes to a log file kept only when the driver reported an error (result["log"]: its path, else None); a
    driver that wrote no result is a GeminiError naming its last line. name: the engine, for the message and
    the temporary files' prefix ("llama.cpp", "vLLM")."""
    prefix = f"gc-{name.lower().replace('.cpp', '')}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        log = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
        with open(log, "w") as out:
            code = subprocess.run([python, str(driver), str(job_path), str(result_path)], stdout=out,
                                  stderr=subprocess.STDOUT, env=env).returncode
        text = log.read_text(errors="replace")
        if not result_path.is_file():
            last = next((ln for ln in reversed(text.strip().splitlines()) if ln.strip()), "no output")
            raise GeminiError(f"{name}'s driver failed on {job.get('model')} (exit {code}): {last[:300]} (log: {log})")
        result = json.loads(result_path.read_text())
    if result.get("error"):
        result["log"] = str(log)  # kept: the engine's whole story of the refusal
    else:
        log.unlink(missing_ok=True)
        result["log"] = None
    return result, text
