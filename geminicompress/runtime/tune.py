"""`tune`: mixed-precision GPTQ whose *measured* drift stays under a budget, in as few bits as it finds.

One round = allocate under a predicted drift budget (a knapsack over a sensitivity table: gptq/allocate.py) ->
GPTQ with those per-module bits -> perplexity on the evaluation text -> the measured drift. The table's
proxy predicts drift in KL units and ranks modules well, but its additive KLs undercount how errors compound
through depth (measured about 2x on the demo model). So the first round asks for the budget itself; while the
measured drift exceeds it, the next round asks for the budget divided by the undercount *this* round
measured, f = log1p(measured) / log1p(predicted), and measures again, at most `rounds` times. The table is
measured once (the first round's, OUT/sensitivity.json) and reused. It ends with the first round under the
budget (that round's checkpoint becomes OUT), or, when no allocation the options allow is under it, in one
line (exit 1) with the best round it found kept beside OUT (`OUT-best/`), not as OUT.

Every round's budget asked, bits per weight, predicted and measured drift go into OUT/allocation.json
(`rounds`), each printed as it ends.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from geminicompress.compress.gptq.allocate import ALLOCATION_FILE, FRONTIER_FILE, TABLE_FILE, table_matrices
from geminicompress.compress.sensitivity.plot import write_frontier
from geminicompress.core.errors import GeminiError

ROUNDS = 4


@dataclass
class Round:
    index: int
    asked_pct: float  # the predicted drift the allocation was asked to stay under
    bits: float  # average stored bits per weight
    predicted_pct: float
    measured_pct: float

    def line(self, budget: float) -> str:
        verdict = "under" if self.measured_pct <= budget else "over"
        return (f"round {self.index}: asked for a predicted +{self.asked_pct:.2f}%, got {self.bits:.3f} bits per "
                f"weight, predicted +{self.predicted_pct:.2f}%, measured +{self.measured_pct:.2f}% ({verdict} "
                f"the +{budget:g}% budget)")


def undercount(predicted_pct: float, measured_pct: float) -> float:
    """How many times the proxy undercounted this round's drift, in KL units (at least 1e-3)."""
    return max(math.log1p(measured_pct / 100) / max(math.log1p(predicted_pct / 100), 1e-12), 1e-3)


def least_predicted(table: dict[str, Any], options: list[str], targets: list[str]) -> float:
    """The smallest predicted drift (percent) any allocation of these options reaches: the dearest choice."""
    _, _, drift = table_matrices(table, options, targets)
    return 100 * math.expm1(float(np.nanmin(drift, axis=1).sum()))


def run_tune(run_round: Callable[[float, str | None, Path], tuple[dict, dict]], out: Path, max_drift: float,
             options: list[str], table: str | None, info: Callable[[str], None], rounds: int = ROUNDS,
             measured_on: str = "") -> dict:
    """Rounds of `run_round(asked_pct, table, round_out) -> (report, allocation.json)` until one measures
    under `max_drift` (percent); that round's checkpoint is moved onto `out`. Returns the rounds' summary."""
    work = out.with_name(f".{out.name}.tune")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    done: list[Round] = []
    asked, floor = max_drift, None
    try:
        for r in range(1, rounds + 1):
            if floor is not None and asked < floor:  # below what any allocation predicts: the dearest one
                asked = floor * (1 + 1e-9)
            folder = work / f"round-{r}"
            report, chosen = run_round(asked, table, folder)
            quality = report["stages"][1]["result"]["quality"]
            done.append(Round(r, round(asked, 4), chosen["average_bits"], chosen["predicted_drift_pct"],
                              round(100 * (quality["ppl_ratio"] - 1), 4)))
            info(done[-1].line(max_drift))
            if table is None and (folder / TABLE_FILE).is_file():
                table = str(shutil.copy(folder / TABLE_FILE, work / TABLE_FILE))
            if floor is None and table is not None:
                floor = least_predicted(json.loads(Path(table).read_text()), options, list(chosen["modules"]))
            if done[-1].measured_pct <= max_drift:  # this round's checkpoint becomes OUT
                if out.exists():
                    shutil.rmtree(out)
                folder.rename(out)
                return _record(out, done, max_drift, done[-1], measured_on)
            if asked <= (floor or 0) * (1 + 1e-6):
                break  # the dearest allocation is over the budget already
            f = undercount(done[-1].predicted_pct, done[-1].measured_pct)
            asked = 100 * math.expm1(math.log1p(max_drift / 100) / f)
        best = min(done, key=lambda x: x.measured_pct)
        keep = out.with_name(f"{out.name}-best")
        shutil.rmtree(keep, ignore_errors=True)
        (work / f"round-{best.index}").rename(keep)
        _record(keep, done, max_drift, best, measured_on)
        raise GeminiError(f"tune: no allocation of {', '.join(options)} measured under +{max_drift:g}% in "
                          f"{len(done)} rounds (best: round {best.index}, +{best.measured_pct:.2f}% at "
                          f"{best.bits:.3f} bits per weight, kept in {keep}, not as {out}); allow more drift or "
                          "add a dearer option (e.g. gptq:b8g64)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _record(out: Path, done: list[Round], max_drift: float, this: Round, measured_on: str) -> dict:
    """The rounds into OUT/allocation.json, this round's measured point on the frontier plot."""
    path = out / ALLOCATION_FILE
    chosen = json.loads(path.read_text())
    chosen.update(measured_drift_pct=this.measured_pct, measured_on=measured_on, max_drift_pct=max_drift,
                  round=this.index, rounds=[asdict(x) for x in done])
    path.write_text(json.dumps(chosen, indent=2) + "\n")
    write_frontier(chosen, out / FRONTIER_FILE)
    return chosen
