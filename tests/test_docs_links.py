"""Every relative link (and #anchor) in README.md, docs/*.md and benchmarks/README.md resolves: the README is a
front page that points into docs/, so a moved section must not leave a dead link behind."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _unfenced(text: str) -> list[str]:
    """The lines outside ``` fences, with inline code removed (links in code are not links)."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            out.append("")
            continue
        out.append("" if fence else re.sub(r"`[^`]*`", "", line))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to dashes, -1/-2 for repeats."""
    seen: dict[str, int] = {}
    res: set[str] = set()
    fence = False
    for line in path.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        t = "".join(c for c in m.group(2).lower() if c.isalnum() or c in " -_" or unicodedata.category(c).startswith("L"))
        s = t.replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        res.add(s if n == 0 else f"{s}-{n}")
    return res


def broken_links(root: Path) -> list[str]:
    bad = []
    pages = [root / "README.md", *[root / n for n in ("CHANGELOG.md", "benchmarks/README.md") if (root / n).exists()]]
    for f in [*pages, *sorted((root / "docs").glob("*.md"))]:
        for i, line in enumerate(_unfenced(f.read_text()), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                p, _, anchor = target.partition("#")
                dest = (f.parent / p).resolve() if p else f
                if not dest.exists():
                    bad.append(f"{f.relative_to(root)}:{i}: missing file {target}")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    bad.append(f"{f.relative_to(root)}:{i}: missing anchor {target}")
    return bad


def test_readme_and_docs_links_resolve():
    assert broken_links(ROOT) == []


def test_the_checker_catches_a_dead_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title here\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#title-here) [gone](docs/b.md) [no anchor](docs/a.md#nope)\n")
    assert len(broken_links(tmp_path)) == 2
