"""Issue #38: perplexity of models on the last windows of plain enwiki, so that students trained on different
texts (enwiki as it is, or respelled: wikitext_style.py) are compared on the same plain text. `distill` holds out
the last `eval_windows` (8) windows of its text; this scores the last WINDOWS (default 32) of 512 tokens, 16,384
tokens in all, so a student trained on plain enwiki may have seen some of the 24 before the held-out 8 (which can
only favour it).

    python benchmarks/studies/distill_text/heldout_enwiki.py smollm2-demo /work/runs/s24_rep0 /tmp/a /tmp/b --name heldout_enwiki

Prints a table (drift against the first model) and writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import DATA, RESULTS, perplexity  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="the reference (the teacher) first, then the students")
    ap.add_argument("--data", default=str(DATA / "enwiki-sample.txt"))
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--name", default="heldout_enwiki")
    args = ap.parse_args()

    from geminicompress.data import pack_windows, read_text, tokenize
    from geminicompress.models.loading import load_model

    rows, windows = [], None
    for path in args.models:
        loaded = load_model(path)
        if windows is None:  # the reference's tokenizer (a student shares its teacher's)
            windows = pack_windows(tokenize(loaded.tokenizer, read_text(args.data, "text")), args.seq_len)[-args.windows:]
        model = loaded.model.float().eval()
        rows.append({"model": path, "perplexity": round(perplexity(model, windows), 4)})
        del model, loaded
    ref = rows[0]["perplexity"]
    print(f"plain held-out {Path(args.data).name}: last {len(windows)} windows of {args.seq_len} tokens\n")
    print("| model | perplexity | drift |\n|---|---|---|")
    for row in rows:
        row["drift"] = round(row["perplexity"] / ref - 1, 4)
        print(f"| {row['model']} | {row['perplexity']:.2f} | {row['drift']:+.1%} |")
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({"data": args.data, "windows": len(windows), "seq_len": args.seq_len, "rows": rows},
                              indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
