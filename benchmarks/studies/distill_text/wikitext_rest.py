"""Write the WikiText-2 test text that the protocol does NOT evaluate: everything after its first 16,384
tokens (plus a margin of 64 tokens), for runs that train or fit on text of the evaluated kind without
touching the evaluated tokens (issue #38: the calibration text, not the method, limits the student).

    python benchmarks/studies/distill_text/wikitext_rest.py /tmp/wikitext_rest.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, EVAL_TOKENS  # noqa: E402

MARGIN = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default="smollm2-demo")
    args = ap.parse_args()
    from geminicompress.data.windows import tokenize
    from geminicompress.models.loading import demo_dir, load_tokenizer

    tok = load_tokenizer(str(demo_dir()) if args.tokenizer == "smollm2-demo" else args.tokenizer, False)
    text = (DATA / "wikitext2-test.txt").read_text()
    head = text[: 40 * EVAL_TOKENS]  # far more characters than the evaluated tokens need
    enc = tok(head, return_offsets_mapping=True, add_special_tokens=False)
    evaluated = tokenize(tok, text, EVAL_TOKENS)
    if enc["input_ids"][:EVAL_TOKENS] != evaluated.tolist():
        raise SystemExit("the tokenizer splits the head of the text differently from the protocol's tokenize()")
    end = enc["offset_mapping"][EVAL_TOKENS + MARGIN][1]
    Path(args.out).write_text(text[end:])
    print(f"wrote {args.out}: the text after character {end:,} ({len(text) - end:,} characters; the protocol evaluates "
          f"the first {EVAL_TOKENS:,} tokens)")


if __name__ == "__main__":
    main()
