"""Write a training text in which each article takes a random spelling style of its own, consistent within
the article: punctuation apart or not, a random marker around a hyphen or a separator inside a word or
number (` #-# `, ` ~,~ `), clitics apart or not, lower case or not, paragraphs on one line or with a blank
line between them. About a quarter of the articles stay as they are.

Issue #38: a cut student trained on enwiki recovers little of what it lost on WikiText-2's spelling,
which the teacher reads in context (docs/distill.md), while the same student trained on enwiki respelled
*as WikiText-2* recovers most of it. This asks whether the skill can be taught generically: here no
article is spelled as WikiText-2 is (its marker `@` is never drawn), but every styled article asks the
student to pick up a spelling from its own context, as the teacher does.

    python benchmarks/studies/distill_text/style_text.py /tmp/enwiki_styles.txt
    python benchmarks/studies/distill_text/style_text.py /tmp/enwiki_styles_noapart.txt --without apart

The styles are `geminicompress.data.restyle`'s (what `distill --restyle` draws), one per article here rather than
per stretch. The 4-minute rows in docs/distill.md were written by this script at commit cbc15fd, whose own copy
also drew '%' as a marker and set a marker's ',' apart with the punctuation: the same experiment, not the same bytes.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA  # noqa: E402

from geminicompress.data.restyle import Style, draw, restyle_line  # noqa: E402

_ARTICLE = re.compile(r"^ = [^=].* = $")
PLAIN = Style(False, "", False, False, False)


def draw_style(rng: random.Random, keep: float, without: frozenset[str] = frozenset()) -> Style:
    """One article's style: PLAIN with probability `keep`, otherwise `restyle.draw` (a feature named in `without`
    never drawn: the controls)."""
    if rng.random() < keep:
        return PLAIN
    return replace(draw(rng), **{f: getattr(PLAIN, f) for f in without})


def restyled(line: str, style: Style) -> str:
    return restyle_line(line, style) + ("\n\n" if style.blank else "\n")


def articles(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    for line in lines:
        if _ARTICLE.match(line) or not out:
            out.append([])
        out[-1].append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"))
    ap.add_argument("--keep", type=float, default=0.25, help="the share of articles left as they are")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--without", default="", help=f"features never drawn, comma-separated: "
                    f"{','.join(f.name for f in fields(Style))}")
    args = ap.parse_args()
    without = frozenset(filter(None, args.without.split(",")))
    if without - {f.name for f in fields(Style)}:
        ap.error(f"--without: unknown feature(s) {sorted(without - {f.name for f in fields(Style)})}")
    rng = random.Random(args.seed)
    groups = articles([p for p in Path(args.data).read_text().split("\n") if p.strip()])
    styled, parts = 0, []
    for group in groups:
        style = draw_style(rng, args.keep, without)
        styled += style != PLAIN
        parts += [restyled(line, style) for line in group]
    Path(args.out).write_text("".join(parts))
    print(f"wrote {args.out}: {len(groups)} articles, {styled} of them restyled")


if __name__ == "__main__":
    main()
