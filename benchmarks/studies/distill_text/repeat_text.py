"""Write a training text in which about half the paragraphs appear twice in a row, so that training windows
hold repeats the teacher predicts in context (issue #38: does distilling on repeats restore the in-context
work that a layer cut loses? Measured: no gain in 4 minutes; docs/distill.md).

    python benchmarks/studies/distill_text/repeat_text.py /tmp/enwiki_rep.txt --share 0.5
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA  # noqa: E402


def repeated(paragraphs: list[str], share: float, seed: int) -> list[str]:
    """Each paragraph, followed by itself again with probability `share`."""
    rng = random.Random(seed)
    out = []
    for p in paragraphs:
        out += [p, p] if rng.random() < share else [p]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"))
    ap.add_argument("--share", type=float, default=0.5, help="the share of paragraphs written twice")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    paragraphs = [p for p in Path(args.data).read_text().split("\n") if p.strip()]
    out = repeated(paragraphs, args.share, args.seed)
    Path(args.out).write_text("\n".join(out) + "\n")
    print(f"wrote {args.out}: {len(out):,} paragraphs, {len(out) - len(paragraphs):,} of them repeats")


if __name__ == "__main__":
    main()
