"""Read a recipe (file or bundled name), apply `--set` overrides, validate, and explain errors in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from geminicompress.data.sources import check_data_spec
from geminicompress.core.errors import InputError
from geminicompress.models.loading import resolve_model
from geminicompress.runtime.recipes.schema import STAGE_CONFIGS, Recipe

BUNDLED_DIR = Path(__file__).parent / "bundled"
# pydantic error types whose own message describe_error replaces (they show no "(got ...)" either)
_MESSAGES = {"extra_forbidden": "unknown key (check the spelling; `geminicompress validate --schema` lists the keys)",
             "missing": "required key is missing"}


def bundled_recipes() -> dict[str, Path]:
    """Bundled recipe name -> file."""
    return {p.stem: p for p in sorted(BUNDLED_DIR.glob("*.yaml"))}


def find_recipe(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    bundled = bundled_recipes()
    if name_or_path in bundled:
        return bundled[name_or_path]
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        raise InputError(f"recipe file {name_or_path} does not exist")
    raise InputError(f"no recipe file or bundled recipe named '{name_or_path}' (bundled: {', '.join(bundled)})")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise InputError(f"{path}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: a recipe is a YAML mapping with keys model, stages, ...")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (values parsed as YAML: 3, true, [1,2], text)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set '{item}': use KEY.PATH=VALUE, e.g. stages.0.bits=3")
        value = yaml.safe_load(raw) if raw else ""
        node: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise InputError(f"--set {key}: '{part}' is not an index of a list of {len(node)}")
                at: int | str = int(part)
            elif isinstance(node, dict):
                at = part
            else:
                raise InputError(f"--set {key}: '{'.'.join(parts[:depth])}' is a value, not a section")
            if depth == len(parts) - 1:
                node[at] = value
            else:
                node = node[at] if isinstance(node, list) else node.setdefault(at, {})
    return data


def describe_error(exc: ValidationError, source: str) -> str:
    """One line: file, key path, what is wrong (and how many more problems there are)."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"] if str(p) not in STAGE_CONFIGS]
    path = ".".join(loc) or "(recipe)"
    msg = _MESSAGES.get(first["type"], first["msg"].removeprefix("Value error, "))
    got = first.get("input")
    if first["type"] not in (*_MESSAGES, "stage_type") and not isinstance(got, (dict, list)) and "got " not in msg:
        msg += f" (got {got!r})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{source}: {path}: {msg}{more}"


def validate(data: dict[str, Any], source: str) -> Recipe:
    """`data` as a Recipe, its model and data references checked too; errors in one line naming `source`."""
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise InputError(describe_error(exc, source)) from exc
    check_paths(recipe, source)
    return recipe


def check_paths(recipe: Recipe, source: str) -> None:
    """Check that every model and data reference exists, without loading anything."""
    refs: list[tuple[str, str]] = [("model", recipe.model), ("calibration.data", recipe.calibration.data)]
    refs += [(f"stages.{i}.{field}", getattr(stage, field)) for i, stage in enumerate(recipe.stages)
             for field in ("data", "teacher", "student", "draft") if getattr(stage, field, None)]
    for key, value in refs:
        try:
            if key.endswith(".data"):
                check_data_spec(value)
            else:
                resolve_model(value)
        except InputError as exc:
            raise InputError(f"{source}: {key}: {exc}") from exc


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> tuple[Recipe, Path]:
    path = find_recipe(name_or_path)
    data = apply_overrides(read_yaml(path), overrides or [])
    return validate(data, str(path)), path


def recipe_from_stage(model: str, stage: dict[str, Any], calibration: dict[str, Any], source: str, **top: Any) -> Recipe:
    """A one-stage recipe built from command-line options (`quantize`, `prune`, `distill`)."""
    data = {"model": model, "stages": [stage], "calibration": calibration, **top}
    return validate(data, source)


def json_schema() -> str:
    return json.dumps(Recipe.model_json_schema(), indent=2)


def recipe_yaml(recipe: Recipe, out_dtype: Any = None) -> str:
    """The recipe as YAML. With `out_dtype` (a torch dtype: what OUT's float weights were written in) it is
    recorded as `output.dtype` (a streamed run writes the input's own unless the recipe names one), so
    OUT/recipe.yaml run again writes the same OUT whichever way it is read."""
    if out_dtype is not None:
        output = recipe.output.model_copy(update={"dtype": str(out_dtype).removeprefix("torch.")})
        recipe = recipe.model_copy(update={"output": output})
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
