"""Every benchmark script the docs name exists: README.md, CHANGELOG.md, docs/*.md and benchmarks/README.md
cite scripts as `benchmarks/.../name.py` (or `.sh`), and a moved or deleted script must not leave a command that
fails with "No such file" behind. benchmarks/README.md also names every script in benchmarks/reproduce/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r"\bbenchmarks/[\w./-]*?\w\.(?:py|sh)\b")


def pages(root: Path) -> list[Path]:
    return [p for p in (root / "README.md", root / "CHANGELOG.md", root / "benchmarks" / "README.md",
                        *sorted((root / "docs").glob("*.md"))) if p.exists()]


def missing_scripts(root: Path) -> list[str]:
    bad = []
    for page in pages(root):
        for i, line in enumerate(page.read_text().split("\n"), 1):
            bad += [f"{page.relative_to(root)}:{i}: {m}" for m in SCRIPT.findall(line) if not (root / m).is_file()]
    return bad


def test_every_cited_benchmark_script_exists():
    bad = missing_scripts(ROOT)
    assert not bad, "cited scripts that do not exist:\n" + "\n".join(bad)


def test_every_reproduce_script_is_in_the_benchmarks_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks" / "reproduce").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts, "benchmarks/reproduce/ holds no script"
    unnamed = [s for s in scripts if f"reproduce/{s}" not in readme]
    assert not unnamed, "scripts in benchmarks/reproduce/ the README does not name: " + ", ".join(unnamed)


def test_finds_a_missing_script(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "reproduce").mkdir(parents=True)
    (tmp_path / "benchmarks" / "reproduce" / "here.py").write_text("")
    (tmp_path / "README.md").write_text("run `python benchmarks/reproduce/here.py` then benchmarks/gone.py\n")
    assert missing_scripts(tmp_path) == ["README.md:1: benchmarks/gone.py"]
