"""Read DATA into one string: local files, a hub dataset, or the offline built-in text.

DATA forms:
- `builtin:pydoc`  Python's own documentation topics (`pydoc_data`), ~460 k characters of English
  prose and code that ship with every CPython: the offline default for the demo.
- a local `.txt`, `.jsonl`, `.json`, `.csv` or `.parquet` file; structured files need a text column
  (`--text-column`, default `text`).
- `name:config:split` (or `name:split`, `name`) for a dataset on the hub via `datasets`,
  e.g. `wikitext:wikitext-2-raw-v1:test`.
Documents are joined with "\n\n", the convention of the WikiText perplexity protocol.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from geminicompress.core.errors import GeminiError, InputError

BUILTIN = {"builtin:pydoc"}
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
JOIN = "\n\n"


def is_file_spec(spec: str) -> bool:
    return spec.lower().endswith(FILE_SUFFIXES) or spec.startswith((".", "/", "~"))


def check_data_spec(spec: str) -> None:
    """Validate DATA without reading it (recipes are checked before any model loads)."""
    if spec in BUILTIN:
        return
    if spec.startswith("builtin:"):
        raise InputError(f"unknown built-in text '{spec}' (available: {', '.join(sorted(BUILTIN))})")
    if is_file_spec(spec):
        if not Path(spec).expanduser().is_file():
            raise InputError(f"data file {spec} does not exist")
        if not spec.lower().endswith(FILE_SUFFIXES):
            raise InputError(f"data file {spec}: unsupported type (use {', '.join(FILE_SUFFIXES)})")


def read_text(spec: str, text_column: str = "text") -> str:
    """The whole text of DATA as one string."""
    check_data_spec(spec)
    if spec == "builtin:pydoc":
        from pydoc_data.topics import topics

        return JOIN.join(topics[k].strip() for k in sorted(topics))
    if is_file_spec(spec):
        return _read_file(Path(spec).expanduser(), text_column)
    return _read_hub(spec, text_column)


def _read_file(path: Path, column: str) -> str:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return path.read_text(encoding="utf-8")
        if suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = data if isinstance(data, list) else data.get("data", data.get("rows", [data]))
        elif suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        else:
            rows = _read_parquet(path, column)
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        raise InputError(f"data file {path} cannot be parsed: {exc}") from exc
    return _column_text(rows, column, str(path))


def _read_parquet(path: Path, column: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InputError("reading .parquet needs pyarrow (installed with `datasets`)") from exc
    table = pq.read_table(path)
    if column not in table.column_names:
        raise InputError(f"data file {path} has no column '{column}' (columns: {', '.join(table.column_names)}); use --text-column")
    return [{column: v} for v in table.column(column).to_pylist()]


def _column_text(rows: list, column: str, where: str) -> str:
    texts = []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            texts.append(row)
            continue
        if not isinstance(row, dict) or column not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise InputError(f"data file {where}: row {i} has no column '{column}' (has: {keys}); use --text-column")
        if row[column]:
            texts.append(str(row[column]))
    return JOIN.join(texts)


def _read_hub(spec: str, column: str) -> str:
    try:
        import datasets
    except ImportError as exc:
        raise InputError("hub datasets need the `datasets` package") from exc
    parts = spec.split(":")
    if len(parts) > 3:
        raise InputError(f"dataset '{spec}': use name, name:split or name:config:split")
    name = parts[0]
    config = parts[1] if len(parts) == 3 else None
    split = parts[-1] if len(parts) >= 2 else "train"
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many unrelated types for offline/unknown names
        raise GeminiError(f"dataset '{spec}' does not load: {str(exc).splitlines()[0][:200]} (offline? use a local file)") from exc
    if column not in ds.column_names:
        raise InputError(f"dataset '{spec}' has no column '{column}' (columns: {', '.join(ds.column_names)}); use --text-column")
    return JOIN.join(t for t in ds[column] if t)
