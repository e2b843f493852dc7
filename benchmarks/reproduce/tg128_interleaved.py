"""tg128 of two GGUF files, interleaved run by run in one process: the machine's drift (clock, cache, a neighbour)
falls on both files alike, which one run per file per process cannot promise (±12% between processes here).

Runs under the python that has llama-cpp-python (numpy and the standard library only). Both models are loaded
once; then `--rounds` rounds, each timing tg128 of A then B (odd rounds) or B then A (even rounds), as llama-bench
times tg: 128 tokens generated one at a time from an empty context, greedy. Prints the medians, the ratio of the
medians and the per-round ratios' median and quartiles; writes the JSON.

    ~/venv-llama/bin/python benchmarks/reproduce/tg128_interleaved.py --a ours=OURS.gguf \
        --b llama=THEIRS.gguf --rounds 21 --threads 2 --out benchmarks/results/gguf_tg128_interleaved.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# the llama.cpp driver's own loading and next-token reading (it imports only the standard library and numpy)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "geminicompress" / "eval" / "engines"))
from llama_driver import _load, _next  # noqa: E402


def tg(llm, n: int) -> float:
    """Seconds for n tokens generated one at a time from an empty context (greedy: the driver's `_next`)."""
    llm.reset()
    tok = 1
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = _next(llm)
    return time.perf_counter() - t0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="NAME=FILE.gguf")
    p.add_argument("--b", required=True, help="NAME=FILE.gguf")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    (na, fa), (nb, fb) = (s.split("=", 1) for s in (args.a, args.b))
    llms = {name: _load(path, args.threads, 256, logits_all=False) for name, path in ((na, fa), (nb, fb))}
    for llm in llms.values():  # warm-up: pages in, caches filled
        tg(llm, args.tg)
    rates = {na: [], nb: []}
    for r in range(args.rounds):
        for name in ((na, nb) if r % 2 == 0 else (nb, na)):
            rates[name].append(args.tg / tg(llms[name], args.tg))
    per_round = [a / b for a, b in zip(rates[na], rates[nb])]
    med = {k: statistics.median(v) for k, v in rates.items()}
    q1, qm, q3 = quartiles(per_round)
    result = {"benchmark": f"tg{args.tg} interleaved, {args.rounds} rounds, alternating order, {args.threads} threads",
              "files": {na: fa, nb: fb}, "tok_s": rates, "median_tok_s": med,
              "ratio_of_medians": med[na] / med[nb], "per_round_ratio_q1_median_q3": [q1, qm, q3]}
    print(f"{na}: {med[na]:.1f} tok/s   {nb}: {med[nb]:.1f} tok/s   {na}/{nb}: {med[na] / med[nb]:.3f} "
          f"(per round: median {qm:.3f}, quartiles {q1:.3f}-{q3:.3f})")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
