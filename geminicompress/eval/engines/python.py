"""Which python runs an engine that lives in its own venv (vLLM, llama.cpp): one rule for both."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from geminicompress.errors import InputError


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
