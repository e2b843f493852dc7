"""Training-free repair variants for one depth cut, measured on the protocol (issue #38).

    python benchmarks/studies/distill/repair_variants_bench.py --dropped 13-18 --fit-windows 32 --threads 1 \
        --variants down:1e-3,down:1e-2,linear:1e-3,cosine:1e-3,down+next:1e-3

Every variant repairs the same cut of the demo (blocks `--dropped` removed) on the same calibration walk
(--fit-windows x 512 tokens of enwiki-sample.txt, seed 0) and is scored on the protocol's WikiText-2
windows (first --eval-tokens tokens, 512-token windows): the teacher's stream up to the block before the
cut is shared, the student's blocks from there on and the head run per variant (the same mean NLL as
`perplexity()`). Variants (`name:ridge`):
- down: block i-1's down_proj refit by least squares towards h_{i+n} (the default repair);
- linear: a d x d map on block i-1's MLP output (ReplaceMe), merged into down_proj;
- cosine: the linear map refined by Adam on the cosine objective (ReplaceMe's cosine variant);
- down+next: `down`, then the first kept block after the cut has its down_proj refit towards the teacher's
  stream at its own boundary, on the repaired inputs (one block of `repair_follow`);
- down+follow: `down` then every later block (repair_follow);
- after: block i-1 left as the teacher's; the first kept block after the cut (i+n) has its down_proj refit
  on its own inputs (computed from h_i) towards h_{i+n+1}: the map carried after the cut, not before it;
- laco+down: LaCo's layer collapse (block i-1 + the sum of the dropped blocks' parameter differences from
  it, norms kept), then down_proj refit;
- o+down: block i-1's attention output projection refit towards h_{i+n} (its MLP output held), then its
  down_proj on the MLP inputs that follow (two closed-form fits in the same block; the attention's output
  carries context the MLP input lacks).
A `/weighting` suffix on the name sets the least squares' token weighting (repair.token_weights):
`down/skip_first:0.1` (position 0, the attention sink, left out), `down/inverse_norm:0.1` (1/||target||^2).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import DATA, RESULTS, SEQ_LEN, calibration_ids, repair_teacher  # noqa: E402

from geminicompress.core.arch import decoder_layers  # noqa: E402
from geminicompress.data import tokenize  # noqa: E402
from geminicompress.data.windows import sample_windows  # noqa: E402
from geminicompress.distill.repair import RepairSpec, refit_block  # noqa: E402
from geminicompress.distill.survey import attn_out, mean_nll, mlp_down, run_layers  # noqa: E402
from geminicompress.engine.forward import embed  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402

CPU = torch.device("cpu")


class _Boundaries:
    """The teacher's stream at the boundaries a variant reads (a Walk keeping only those, to fit many windows)."""

    def __init__(self, hidden: dict[int, torch.Tensor], kwargs) -> None:
        self.hidden, self.kwargs = hidden, kwargs


def light_walk(teacher, windows: torch.Tensor, keep: set[int]) -> _Boundaries:
    first = embed(teacher, windows, device=CPU)
    kwargs = first.layer_kwargs[0] if isinstance(first.layer_kwargs, list) else first.layer_kwargs
    h, kept = first.tensor, {}
    for i, layer in enumerate(decoder_layers(teacher)):
        if i in keep:
            kept[i] = h
        if i >= max(keep):
            break
        h = run_layers([layer], h, kwargs, device=CPU)
    return _Boundaries(kept, kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-demo")
    ap.add_argument("--dropped", default="13-18")
    ap.add_argument("--fit-windows", type=int, default=32)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="down:1e-3")
    ap.add_argument("--fit-data", default="enwiki", choices=["enwiki", "wikitext"],
                    help="fit windows from enwiki-sample.txt (the protocol) or from WikiText-2 tokens after the "
                    "evaluation's (disjoint from them; the kind of text evaluated)")
    ap.add_argument("--name", default="repair_variants")
    args = ap.parse_args()
    t0 = time.perf_counter()
    teacher, tok, evalw = repair_teacher(args.teacher, args.threads, args.eval_tokens)
    L = teacher.config.num_hidden_layers
    dropped = parse_layers(args.dropped)
    assert dropped == list(range(dropped[0], dropped[-1] + 1)), "one contiguous span"
    lo, hi = dropped[0], dropped[-1]
    kept = [i for i in range(L) if i not in dropped]
    fitw = calibration_ids(tok, args.fit_windows)
    if args.fit_data == "wikitext":
        fitw = sample_windows(tokenize(tok, (DATA / "wikitext2-test.txt").read_text())[args.eval_tokens:],
                              args.fit_windows, SEQ_LEN, 0)
    layers = decoder_layers(teacher)
    down = mlp_down(teacher)
    fit = light_walk(teacher, fitw, {lo - 1, lo, hi + 1, hi + 2})
    first = embed(teacher, evalw, device=CPU)
    kwargs = first.layer_kwargs[0] if isinstance(first.layer_kwargs, list) else first.layer_kwargs
    h_eval = run_layers(list(layers[: lo - 1]), first.tensor, kwargs, device=CPU)  # input of block lo-1
    out_path = RESULTS / f"{args.name}.json"
    result = {"args": vars(args), "machine": machine(), "versions": versions(), "kept": kept, "variants": {}}
    teacher_nll = mean_nll(teacher, run_layers(list(layers[lo - 1:]), h_eval, kwargs, device=CPU), evalw, device=CPU)
    result["teacher_ppl"] = round(math.exp(teacher_nll), 4)
    print(f"[{time.perf_counter() - t0:.0f}s] teacher {result['teacher_ppl']}", flush=True)
    after = [t for t in kept if t > hi]  # the kept blocks after the cut
    for v in args.variants.split(","):
        name, ridge = v.split(":")
        ridge = float(ridge)
        name, _, weighting = name.partition("/")
        block = copy.deepcopy(layers[lo - 1])
        rest = [layers[t] for t in after]
        mode = "linear" if name in ("linear", "cosine") else "down_proj"
        spec = RepairSpec(mode, "cosine" if name == "cosine" else "mse", ridge, weighting=weighting or "uniform")
        if name == "after":  # block lo-1 as the teacher's; the first kept block after the cut carries the map
            rest = [copy.deepcopy(b) for b in rest]
            _, err = refit_block(rest[0], down, fit.hidden[lo], fit.hidden[hi + 2], fit.kwargs, spec, device=CPU)
            rows = [err]
        elif name == "laco+down":  # LaCo (Yang et al. 2024): the dropped blocks' differences added to block i-1
            with torch.no_grad():
                for (pn, p), *others in zip(block.named_parameters(),
                                            *[layers[d].parameters() for d in dropped]):
                    if "norm" not in pn:
                        p.add_(sum(o - p for o in others))
            h, err = refit_block(block, down, fit.hidden[lo - 1], fit.hidden[hi + 1], fit.kwargs, spec, device=CPU)
            rows = [err]
        elif name == "o+down":  # the attention's output projection refit first (the MLP's output held), then down_proj
            _, err_o = refit_block(block, attn_out(teacher), fit.hidden[lo - 1], fit.hidden[hi + 1], fit.kwargs, spec,
                                   device=CPU)
            h, err = refit_block(block, down, fit.hidden[lo - 1], fit.hidden[hi + 1], fit.kwargs, spec, device=CPU)
            rows = [err_o, err]
        else:
            h, err = refit_block(block, down, fit.hidden[lo - 1], fit.hidden[hi + 1], fit.kwargs, spec, device=CPU)
            rows = [err]
        if name in ("down+next", "down+follow"):
            rest = [copy.deepcopy(b) for b in rest]
            n_follow = 1
            assert name == "down+next", "down+follow needs every boundary: use the plan bench's --follow"
            for j in range(n_follow):
                t = after[j]
                h, err = refit_block(rest[j], down, h, fit.hidden[t + 1], fit.kwargs,
                                     RepairSpec("down_proj", ridge=ridge, weighting=weighting or "uniform"),
                                     device=CPU)
                rows.append(err)
        out = run_layers([block, *rest], h_eval, kwargs, device=CPU)
        ppl = math.exp(mean_nll(teacher, out, evalw, device=CPU))
        result["variants"][v] = {"ppl": round(ppl, 4), "drift": round(ppl / result["teacher_ppl"] - 1, 4),
                                 "fit_errors": [{k: round(x, 5) for k, x in r.items()} for r in rows]}
        print(f"[{time.perf_counter() - t0:.0f}s] {v}: ppl {ppl:.3f} drift {ppl / result['teacher_ppl'] - 1:+.1%} "
              f"errors {rows[0]}", flush=True)
        out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
