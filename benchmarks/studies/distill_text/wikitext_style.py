"""Rewrite a plain Wikipedia text in WikiText-2's spelling: the same words, split the way WikiText's
preprocessing split them (` , ` and ` . ` with spaces, ` @-@ ` for a hyphen inside a word, ` @,@ ` and
` @.@ ` inside numbers, ` 's ` and ` 't ` apart, `= = Section = =` headings, one paragraph a line).

Issue #38's diagnostic: a student trained on enwiki heals far less on the protocol (WikiText-2) than one
trained on WikiText-2's own text, and a third of the cut's damage sits on those spellings. Training on
enwiki respelled this way separates the spelling from the content (docs/distill.md). It is a diagnostic,
not advice: a student trained this way learns WikiText's spelling, which no user serves.

    python benchmarks/studies/distill_text/wikitext_style.py /tmp/enwiki_wt.txt
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA  # noqa: E402

from geminicompress.data.restyle import Style, restyle_line  # noqa: E402

_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*=+\s*$")
WIKITEXT = Style(apart=True, marker="@", clitics=True, lower=False, blank=False)  # one of restyle's styles, its '@'


def respell(line: str) -> str:
    """One paragraph in WikiText-2's tokenization, e.g. 'a well-known 1,000.5' -> 'a well @-@ known 1 @,@ 000 @.@ 5'."""
    return restyle_line(line, WIKITEXT)


def wikitext_lines(line: str) -> str:
    """A paragraph or heading of the input as WikiText-2 writes it (a leading and trailing space, a blank line after)."""
    head = _HEADING.match(line)
    if head:
        marks = " ".join(["="] * len(head.group(1)))
        return f" \n {marks} {respell(head.group(2))} {marks} \n \n"
    return f" {respell(line)} \n \n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"))
    args = ap.parse_args()
    lines = [p for p in Path(args.data).read_text().split("\n") if p.strip()]
    Path(args.out).write_text("".join(wikitext_lines(p) for p in lines))
    print(f"wrote {args.out}: {len(lines):,} paragraphs and headings respelled")


if __name__ == "__main__":
    main()
