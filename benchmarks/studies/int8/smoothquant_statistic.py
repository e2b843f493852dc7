"""Quantize with SmoothQuant's activation statistic swapped, to compare it with the default (docs/int8.md).

The default (compress/int8/smoothquant.py) takes each channel's max |x| per calibration window and
averages it over the windows. This script runs `geminicompress quantize` with another statistic patched in:

  max            max |x| over all tokens of all windows (the SmoothQuant paper; our former default)
  max-but-first  the same without each window's first token (the attention sink)

    python benchmarks/studies/int8/smoothquant_statistic.py max quantize smollm2-demo -o OUT --method w8a8 --samples 32
    geminicompress eval smollm2-demo OUT --data ../shared/data/wikitext2-test.txt --max-tokens 16384 \
        --seq-len 512 --no-latency -o REPORT
"""

from __future__ import annotations

import sys

import torch

from geminicompress.compress.int8 import smoothquant as sq


def patched(skip_first: bool):
    @torch.no_grad()
    def activation_maxima(model, windows, names, progress=None):
        maxima: dict[str, torch.Tensor] = {}

        def record(name: str, x: torch.Tensor) -> None:
            a = x.detach().float().abs()
            a = a[:, 1:] if skip_first else a  # (b, T, in)
            m = a.reshape(-1, a.shape[-1]).amax(dim=0)
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m

        sq.run_windows(model, windows, names, record, progress)
        return {n: m.cpu() for n, m in maxima.items()}

    return activation_maxima


def main() -> None:
    statistic, *cli = sys.argv[1:]
    if statistic not in ("max", "max-but-first"):
        sys.exit("first argument: max | max-but-first (the default statistic needs no script)")
    sq.activation_maxima = patched(skip_first=statistic == "max-but-first")
    from geminicompress.cli import main as cli_main

    sys.argv = ["geminicompress", *cli]
    cli_main()


if __name__ == "__main__":
    main()
