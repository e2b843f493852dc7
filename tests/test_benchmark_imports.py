"""Every name a benchmark (benchmarks/**/*.py) or a test imports from the package exists: a rename in the
package must not leave a benchmark that fails with ImportError only when someone runs it (three did, after
`_demo_dir` became `demo_dir`)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if "results" not in p.parts)


def package_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every `from geminicompress... import name` in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module, alias.name, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] == "geminicompress" for alias in node.names]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "benchmarks")))
def test_benchmark_imports_exist(script: Path) -> None:
    missing = []
    for module, name, line in package_imports(script):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ModuleNotFoundError:
                missing.append(f"{script.name}:{line}: {module}.{name}")
    assert not missing, "names the package no longer has: " + ", ".join(missing)


def test_finds_a_missing_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from geminicompress.models.loading import _demo_dir\n")
    assert package_imports(bad) == [("geminicompress.models.loading", "_demo_dir", 2)]
    assert not hasattr(importlib.import_module("geminicompress.models.loading"), "_demo_dir")
