"""The paths a run reads, as (what, path) pairs for the output-directory contract (output.check_output_path):
OUT must never be, or hold, one of them.

A recipe's inputs are its fields that name a model or a file (INPUT_FIELDS), wherever they sit (a stage, a
nested allocation); a model spec adds where its weights lie when that is not the spec itself (the demo alias's
GGUF file and converted copy in the cache, a hub id's folder in the hub cache). Specs naming nothing on this
disk (a hub dataset, builtin:pydoc) come along too: check_output_path skips them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from geminicompress.core.errors import InputError
from geminicompress.models import demo
from geminicompress.runtime.recipes.schema import Recipe

# Every recipe field that names a model or a file the run reads (tests/test_output_inputs.py checks that each
# str field of the schema is here or in NOT_PATHS, so a new path field cannot be forgotten)
MODEL_FIELDS = ("model", "teacher", "student", "draft")
INPUT_FIELDS = (*MODEL_FIELDS, "data", "plan_data", "student_config", "search_results", "sensitivity",
                "vllm_python", "llama_python")
NOT_PATHS = ("description", "text_column", "ignore", "tasks", "pattern", "options", "overrides")


def model_inputs(what: str, spec: str | None) -> list[tuple[str, str]]:
    """MODEL's paths: the spec itself, and for the demo alias its GGUF file and its converted copy in the
    cache, for a hub id its folder in the hub cache (when they exist; nothing is converted or downloaded)."""
    if not spec:
        return []
    found = [(what, spec)]
    if spec == demo.DEMO_ALIAS:
        try:
            found += [(what, str(demo.demo_gguf_path())), (what, str(demo.demo_cache_dir()))]
        except InputError:  # not installed: loading it says so, in its own line
            pass
    elif not Path(spec).expanduser().exists() and not spec.startswith((".", "/", "~")) and spec.count("/") <= 1:
        from huggingface_hub.constants import HF_HUB_CACHE

        found.append((what, os.path.join(HF_HUB_CACHE, "models--" + spec.replace("/", "--"))))
    return found


def recipe_inputs(recipe: Recipe, recipe_file: str | Path | None = None) -> list[tuple[str, str]]:
    """Every path `recipe` reads (its models, data, teacher, student, draft, saved searches and sensitivity
    tables), and the recipe file itself when given; labels name the key (`stages.1.data`)."""
    found = [("recipe file", str(recipe_file))] if recipe_file is not None else []
    _walk(recipe.model_dump(mode="json"), "", found)
    return found


def _walk(node: Any, key: str, found: list[tuple[str, str]]) -> None:
    if isinstance(node, dict):
        for name, value in node.items():
            where = f"{key}.{name}" if key else name
            if name in INPUT_FIELDS and isinstance(value, str):
                found += model_inputs(where, value) if name in MODEL_FIELDS else [(where, value)]
            else:
                _walk(value, where, found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, f"{key}.{i}", found)
