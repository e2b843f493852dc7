"""Distillation benchmark on the demo model (SmolLM2-135M, 30 layers), CPU.

Run alone on the machine:  python benchmarks/reproduce/distill_bench.py [--quick]

1. A 15-layer student (every other layer, first and last kept, weights copied) is trained for the same
   token budget on ../shared/data/enwiki-sample.txt (a) by knowledge distillation (forward KL to the
   30-layer teacher) and (b) by plain cross-entropy fine-tuning. Perplexity by the one protocol (first
   16,384 tokens of wikitext2-test.txt, 32 windows of 512) of: teacher, un-distilled student, KD, CE.
2. Time per output token, student vs teacher: greedy generation of a fixed budget, median of repeats;
   plus the KD student as a speculative draft for the teacher (assisted generation).
3. Recovery: the demo model pruned to 40% global magnitude (decoder linears), perplexity drift against
   the dense model before and after distilling from the dense original for the same token budget,
   with the pruned zeros kept; with --reconstruct N, the pruned layers are first refit to the dense ones
   in closed form on N calibration windows (distill/reconstruct.py), and the drift after that is reported too.
Each phase's result is written to benchmarks/results/distill_bench.json as soon as it is known.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # for common.py

from common import calibration_ids  # noqa: E402

from geminicompress.data import pack_windows, tokenize  # noqa: E402
from geminicompress.distill.masks import sparsity  # noqa: E402
from geminicompress.distill.plot import plot_curve  # noqa: E402
from geminicompress.distill.reconstruct import reconstruct  # noqa: E402
from geminicompress.distill.student import derive_student, n_params  # noqa: E402
from geminicompress.distill.train import Guides, TrainRun, train  # noqa: E402
from geminicompress.eval.quality.perplexity import perplexity  # noqa: E402
from geminicompress.eval.speculative import generation_speed, measure_speculative  # noqa: E402
from geminicompress.host.machine import machine, versions  # noqa: E402
from geminicompress.models.loading import load_model  # noqa: E402
from geminicompress.distill.config import DistillStage  # noqa: E402

CPU = torch.device("cpu")


class Log:
    """Progress to stdout for the benchmark (library code never prints; scripts may)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def task(self, description, total):
        from contextlib import contextmanager

        log = self

        class Bar:
            def __init__(self) -> None:
                self.done = 0

            def advance(self, n=1, **fields):
                self.done += n
                if self.done % 10 == 0 or self.done == total:
                    info = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
                    log.info(f"{description} {self.done}/{total} {info}")

        @contextmanager
        def cm():
            yield Bar()

        return cm()

    def info(self, message):
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {message}", flush=True)

    def warn(self, message):
        self.info("warning: " + message)


def prune_global_magnitude(model, fraction: float) -> dict[str, torch.Tensor]:
    """Zero the `fraction` smallest-magnitude weights over all decoder-layer linears together."""
    weights = {n: p for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    flat = torch.cat([p.detach().abs().flatten() for p in weights.values()])
    k = int(fraction * flat.numel())
    threshold = flat.kthvalue(k).values if flat.numel() < 2**24 else flat.sort().values[k - 1]
    masks = {}
    with torch.no_grad():
        for name, p in weights.items():
            masks[name] = p.abs() > threshold
            p.mul_(masks[name])
    return masks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a cut-down run: few steps and windows")
    ap.add_argument("--budget-tokens", type=int, default=None, help="training tokens per run")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--recovery-lr", type=float, default=1e-4, help="the pruned 30-layer model starts close to its teacher")
    ap.add_argument("--phases", default="kd,ce,latency,recovery")
    ap.add_argument("--reconstruct", type=int, default=0, metavar="N",
                    help="recovery: first refit the pruned layers to the dense ones on N calibration windows (0: off)")
    ap.add_argument("--recovery-loss", default='{"kl": 1.0}', help="recovery loss weights as JSON")
    ap.add_argument("--student-dir", default="/tmp/gc-distill-bench-kd-student",
                    help="the KD student is saved here, and a run with --phases latency alone reuses it")
    ap.add_argument("--name", default=None, help="results file name (default distill_bench)")
    ap.add_argument("--mlp-ratio", type=float, default=1.0,
                    help="student MLP width as a fraction of the teacher's (0.5: half-width MLPs, the latency knob)")
    ap.add_argument("--eval-windows", type=int, default=32, help="protocol: 32 windows of 512 (fewer when time is short)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    log = Log()
    name = args.name or ("distill_bench_quick" if args.quick else "distill_bench")
    out_json = RESULTS / f"{name}.json"
    res = json.loads(out_json.read_text()) if out_json.is_file() else {}
    res.update({"machine": machine(), "versions": versions(), "command": " ".join(sys.argv), "args": vars(args)})

    def save():
        RESULTS.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(res, indent=2, default=str) + "\n")

    loaded = load_model("smollm2-demo")
    teacher, tok = loaded.model, loaded.tokenizer
    teacher.requires_grad_(False)
    n_eval = 4 if args.quick else args.eval_windows
    eval_w = pack_windows(tokenize(tok, (DATA / "wikitext2-test.txt").read_text(), 16384), 512, n_eval)
    train_all = pack_windows(tokenize(tok, (DATA / "enwiki-sample.txt").read_text()), args.seq_len)
    held_out, train_w = train_all[-2:], train_all[:-2]
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    budget = args.budget_tokens or (4 * tokens_per_step if args.quick else 20 * tokens_per_step)
    steps = max(1, budget // tokens_per_step)
    res["budget"] = {"tokens": steps * tokens_per_step, "steps": steps, "tokens_per_step": tokens_per_step,
                     "train_windows": len(train_w)}
    log.info(f"{len(train_w)} training windows; {steps} steps x {tokens_per_step} tokens per run")

    def cfg(lr, **loss):
        return DistillStage(type="distill", steps=steps, seq_len=args.seq_len, batch_size=args.batch_size,
                            grad_accum=args.grad_accum, lr=lr, warmup_steps=max(1, steps // 10),
                            temperature=1.0, loss=loss, eval_every=max(1, steps // 5), eval_windows=2)

    def ppl(model) -> float:
        t0 = time.perf_counter()
        value = perplexity(model, eval_w, CPU, batch_size=4)
        log.info(f"  ppl {value:.3f} ({time.perf_counter() - t0:.0f} s)")
        return value

    def run(student, loss, masks=None, label="", lr=args.lr, layer_map=None):
        import tempfile

        log.info(f"training {label}: {loss}")
        with tempfile.TemporaryDirectory() as state:
            trained, h = train(student, teacher, train_w, held_out, cfg(lr, **loss), TrainRun(0, Path(state), CPU, log),
                               Guides(layer_map=layer_map, masks=masks))
        return trained, {"loss": h.loss, "held_out_ppl": h.ppl, "tokens": h.tokens, "train_seconds": h.seconds,
                         "tokens_per_s": h.tokens / h.seconds}

    phases = args.phases.split(",")
    if "teacher_ppl" not in res or args.quick:
        res["teacher_ppl"] = ppl(teacher)
        save()
    base, kept = derive_student(teacher, 0.5, mlp_ratio=args.mlp_ratio)
    res["student"] = {"kept_layers": kept, "mlp_ratio": args.mlp_ratio, "params": n_params(base),
                      "teacher_params": n_params(teacher)}
    if "kd" in phases or "ce" in phases:
        res["undistilled_ppl"] = ppl(base)
        save()
    kd_student = None
    if "kd" in phases:
        kd_student, res["kd"] = run(copy.deepcopy(base), {"kl": 1.0}, label="KD (forward KL, T=1)")
        res["kd"]["ppl"] = ppl(kd_student)
        kd_student.save_pretrained(args.student_dir)
        tok.save_pretrained(args.student_dir)  # a loadable model directory (load_model needs the tokenizer)
        plot_curve(res["kd"]["loss"], res["kd"]["held_out_ppl"], RESULTS / f"{name}_kd_curve.png", "KD: 30 -> 15 layers")
        save()
    if "ce" in phases:
        ce_student, res["ce"] = run(copy.deepcopy(base), {"kl": 0.0, "ce": 1.0}, label="CE fine-tuning")
        res["ce"]["ppl"] = ppl(ce_student)
        save()
        del ce_student
    if "latency" in phases:
        prompt = eval_w[0:1, :128]
        gen = 16 if args.quick else 64
        reps = 1 if args.quick else 5
        if kd_student is None and (Path(args.student_dir) / "config.json").is_file():
            kd_student = load_model(args.student_dir).model  # the KD student of an earlier run
            res["latency_student"] = f"KD student loaded from {args.student_dir}"
        student = kd_student if kd_student is not None else base
        res["latency"] = {"prompt_len": 128, "gen_len": gen, "repeats": reps}
        # the architecture knob: 15 layers with MLPs at half width (latency only: it does not depend on training)
        narrow, _ = derive_student(teacher, 0.5, mlp_ratio=0.5)
        models = (("teacher", teacher), ("student", student), ("student_mlp_half", narrow))
        for label, model in models + models:  # interleaved, twice: drift in machine speed hits all alike
            speed = generation_speed(model.eval(), prompt, gen, reps, 1)
            res["latency"].setdefault(label, []).append(speed["s_per_token"])
        t = statistics.median(res["latency"]["teacher"])
        s = statistics.median(res["latency"]["student"])
        n = statistics.median(res["latency"]["student_mlp_half"])
        res["latency"]["ratio"] = s / t
        res["latency"]["ratio_mlp_half"] = n / t
        res["latency"]["params"] = {"teacher": n_params(teacher), "student": n_params(student), "student_mlp_half": n_params(narrow)}
        log.info(f"  s/token teacher {t * 1e3:.1f} ms, student {s * 1e3:.1f} ms (ratio {s / t:.3f}), "
                 f"half-width MLP student {n * 1e3:.1f} ms (ratio {n / t:.3f})")
        if kd_student is not None:  # an un-distilled draft (ppl ~1e6) would only time rejections
            spec = measure_speculative(teacher, student, tok, prompt, gen, reps, 1)
            res["speculative"] = spec
            log.info(f"  speculative: speed-up {spec['speedup']:.2f}x acceptance {spec['acceptance_rate']:.2f}")
        else:
            res["speculative"] = "not measured: no KD student (run --phases kd first)"
        save()
    if "recovery" in phases:
        pruned = copy.deepcopy(teacher).requires_grad_(True)
        masks = prune_global_magnitude(pruned, 0.4)
        rec = {"sparsity_before": sparsity(pruned, masks), "dense_ppl": res["teacher_ppl"], "pruned_ppl": ppl(pruned)}
        if args.reconstruct:
            windows = calibration_ids(tok, args.reconstruct)
            log.info(f"reconstructing the pruned layers on {len(windows)} calibration windows")
            rebuilt = reconstruct(pruned, teacher, windows, masks, device=CPU, progress=log)
            rec["reconstruct"] = {k: rebuilt[k] for k in ("windows", "seq_len", "damp", "seconds")}
            rec["reconstructed_ppl"] = ppl(pruned)
            rec["drift_reconstructed"] = rec["reconstructed_ppl"] / rec["dense_ppl"] - 1
        loss = json.loads(args.recovery_loss)
        layer_map = {i: i for i in range(pruned.config.num_hidden_layers)}  # hidden losses: layer i to layer i
        pruned, train_info = run(pruned, loss, masks=masks, label="recovery (pruned 40% -> KD from dense)",
                                 lr=args.recovery_lr, layer_map=layer_map)
        rec.update(train_info)
        rec["recovered_ppl"] = ppl(pruned)
        rec["sparsity_after"] = sparsity(pruned, masks)
        rec["drift_before"] = rec["pruned_ppl"] / rec["dense_ppl"] - 1
        rec["drift_after"] = rec["recovered_ppl"] / rec["dense_ppl"] - 1
        res["recovery"] = rec
        log.info(f"  drift before {rec['drift_before']:.2%} after {rec['drift_after']:.2%} "
                 f"(sparsity {rec['sparsity_after']:.3f})")
        save()
    _table(res)


def _table(res: dict) -> None:
    rows = [("teacher (30 layers)", res.get("teacher_ppl"))]
    rows.append(("15-layer student, un-distilled", res.get("undistilled_ppl")))
    for key, label in (("kd", "15-layer student, KD"), ("ce", "15-layer student, CE fine-tune")):
        if key in res:
            rows.append((label, res[key]["ppl"]))
    print("\n| model | wikitext2 ppl |\n|---|---|")
    for label, value in rows:
        if value is not None:
            print(f"| {label} | {value:.2f} |")
    if "latency" in res:
        print(f"\ntime per output token, student / teacher: {res['latency']['ratio']:.3f}")
        if "ratio_mlp_half" in res["latency"]:
            print(f"time per output token, half-width-MLP student / teacher: {res['latency']['ratio_mlp_half']:.3f}")
    if "recovery" in res:
        r = res["recovery"]
        if "reconstructed_ppl" in r:
            print(f"recovery: reconstructed (no training) {r['reconstructed_ppl']:.2f} ({r['drift_reconstructed']:+.1%})")
        print(f"recovery: pruned {r['pruned_ppl']:.2f} ({r['drift_before']:+.1%}) -> {r['recovered_ppl']:.2f} "
              f"({r['drift_after']:+.1%}), sparsity {r['sparsity_after']:.3f}")


if __name__ == "__main__":
    main()
