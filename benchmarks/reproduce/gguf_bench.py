"""The anchors side by side in llama.cpp: its own quantizer against ours, every row a GGUF file of the same float
demo model scored by llama.cpp itself on the same windows, with bits per weight and file size beside it.

Rows:
- float: the demo as F32 (llama.cpp's exact dequantization of the shipped Q4_1 file, `allow_requantize`);
- llama.cpp's quantizer (`llama_model_quantize`) on that F32 file: Q4_0, Q5_0, Q8_0; Q4_0 and Q5_0 with an
  importance matrix (`params.imatrix`: mean x² per input channel of every linear, keyed by GGUF tensor name,
  from our own calibration walk over the same 32 x 512 windows); Q4_K_M (on the demo most tensors fall back
  to Q5_0/Q8_0: 576 is not a multiple of 256);
- ours, written by `quantize --format gguf` (GPTQ -> Q4_0 and Q5_0, AWQ -> Q4_1 and Q5_0, RTN -> Q4_0,
  int8 -> Q8_0): run only when this build's `quantize` knows `--format gguf`, else listed as not built.

Caveat: the demo's float weights lie on a Q4_1 grid, so Q4_1 (and K-quant mins) re-quantize them almost
losslessly: never rank at Q4_1 on the demo; Q4_0, Q5_0 and Q8_0 are fair.

Protocol: perplexity by llama.cpp (llama-cpp-python, eval/engines/llama_driver.py) over the first 8,192 WikiText-2 test
tokens (transformers tokenizer ids) in 16 windows of 512; KL to the F32 row over its top 16 tokens + rest (a
lower bound). No timings (the machine is shared). Two phases, so a long build can be resumed:

  python benchmarks/reproduce/gguf_bench.py --build-only      # the GGUF files (and the importance matrix) in --work
  python benchmarks/reproduce/gguf_bench.py --score-only      # llama.cpp scores every file there: table + JSON
  python benchmarks/reproduce/gguf_bench.py --rows llama-q4_0-imatrix,llama-q5_0-imatrix   # a subset, both phases
  python benchmarks/reproduce/gguf_bench.py --rows ours-gptq-q4_0,ours-rtn-q4_0 --no-baseline --threads 1 \
      --include benchmarks/results/gguf_bench_llama.json --name gguf_bench   # ours beside rows scored before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, RESULTS, ROOT, calibration_ids, eval_windows  # noqa: E402

LLAMA_ROWS = {  # name -> (llama.cpp ftype, with the importance matrix)
    "llama-q8_0": ("Q8_0", False), "llama-q4_0": ("Q4_0", False), "llama-q4_0-imatrix": ("Q4_0", True),
    "llama-q5_0": ("Q5_0", False), "llama-q5_0-imatrix": ("Q5_0", True), "llama-q4_k_m": ("Q4_K_M", False),
    # issue #63: llama-quantize's mixes with the importance matrix, beside ours of the same mix (--gguf-type)
    "llama-iq4_nl-imatrix": ("IQ4_NL", True), "llama-q3_k_m-imatrix": ("Q3_K_M", True),
    "llama-q2_k-imatrix": ("Q2_K", True), "llama-q4_k_m-imatrix": ("Q4_K_M", True),
    "llama-q5_k_m-imatrix": ("Q5_K_M", True), "llama-q6_k-imatrix": ("Q6_K", True),
}
CALIB = ["--data", str(DATA / "enwiki-sample.txt"), "--samples", "32", "--calib-seq-len", "512"]
OURS_ROWS = {  # name -> quantize arguments (written as OUT/model.gguf by --format gguf)
    "ours-gptq-q4_0": ["--method", "gptq", "--bits", "4", "--group-size", "32", *CALIB],
    "ours-gptq-q5_0": ["--method", "gptq", "--bits", "5", "--group-size", "32", *CALIB],
    "ours-awq-q4_1": ["--method", "awq", "--bits", "4", "--group-size", "32", "--gguf-asym", "q4_1", *CALIB],
    "ours-awq-q5_0": ["--method", "awq", "--bits", "4", "--group-size", "32", "--gguf-asym", "q5_0", *CALIB],
    "ours-rtn-q4_0": ["--method", "rtn", "--bits", "4", "--group-size", "32", "--sym"],
    "ours-int8-q8_0": ["--method", "int8", *CALIB],
    # issue #63: GPTQ with llama-quantize's per-tensor types (the same layout as llama.cpp's file of that mix)
    "ours-gptq-mix-q4_0": ["--method", "gptq", "--gguf-type", "Q4_0", *CALIB],
    "ours-gptq-mix-iq4_nl": ["--method", "gptq", "--gguf-type", "IQ4_NL", *CALIB],
    "ours-gptq-mix-q3_k_m": ["--method", "gptq", "--gguf-type", "Q3_K_M", *CALIB],
    "ours-gptq-mix-q2_k": ["--method", "gptq", "--gguf-type", "Q2_K", *CALIB],
    "ours-gptq-mix-q4_k_m": ["--method", "gptq", "--gguf-type", "Q4_K_M", *CALIB],
    "ours-gptq-mix-q5_k_m": ["--method", "gptq", "--gguf-type", "Q5_K_M", *CALIB],
    "ours-gptq-mix-q6_k": ["--method", "gptq", "--gguf-type", "Q6_K", *CALIB],
}
NOT_RANKED = {"ours-awq-q4_1": "not ranked: the demo's floats lie on a Q4_1 grid",
              "ours-gptq-mix-q4_k_m": "not ranked: Q4_K's mins can find the demo's Q4_1 grid",
              "llama-q4_k_m-imatrix": "not ranked: Q4_K's mins can find the demo's Q4_1 grid"}
# rows whose codes another row's run already chose (the AWQ search does not depend on the GGUF type): exported
# from that row's checkpoint with this --gguf-asym instead of searching again
SAME_CODES = {"ours-awq-q4_1": ("ours-awq-q5_0", "q4_1")}
LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def llama_python() -> str:
    from geminicompress.eval.engines.llama_eval import find_python

    return find_python(os.environ.get("GEMINICOMPRESS_LLAMA_PYTHON") or "/work/venv-llama/bin/python")


def importance_matrix(calib: torch.Tensor, name: str = "smollm2-demo") -> dict[str, list[float]]:
    """Mean x² per input channel of every decoder linear of model `name` over the calibration windows, keyed by
    GGUF tensor name (blk.N.attn_q.weight ...): what llama.cpp's `llama-imatrix` computes, from our calibration walk."""
    from geminicompress.models.loading import load_model

    model = load_model(name).model
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for path, short in LINEARS.items():
            name = f"blk.{i}.{short}.weight"
            module = layer.get_submodule(path)

            def hook(mod, args, out, name=name):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                sums[name] = sums.get(name, 0) + x.square().sum(0)
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for b in range(0, len(calib), 4):
            model.model(calib[b:b + 4])  # the decoder only: the head is not a linear llama.cpp quantizes here
    for h in hooks:
        h.remove()
    return {k: (v / counts[k]).tolist() for k, v in sums.items()}


def knows_gguf() -> bool:
    """Whether this build's `quantize` writes --format gguf (issue #37's exporter)."""
    try:
        from geminicompress.compress.gptq.config import GPTQStage

        GPTQStage(method="gptq", format="gguf")
        return True
    except Exception:
        return False


def build(work: Path, rows: list[str], python: str) -> dict[str, str]:
    """Write the GGUF file of every row in `rows` under `work`; returns {row: why not built}."""
    from geminicompress.eval.engines.llama_eval import demo_f32, run_driver
    from geminicompress.models.loading import load_model

    work.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    f32 = work / "float-f32.gguf"
    if not f32.is_file():
        f32.write_bytes(demo_f32(python).read_bytes())
    imatrix_path = work / "imatrix.json"
    if any(LLAMA_ROWS.get(r, ("", False))[1] for r in rows) and not imatrix_path.is_file():
        tok = load_model("smollm2-demo").tokenizer
        imatrix_path.write_text(json.dumps(importance_matrix(calibration_ids(tok, 32))))
    for row in rows:
        dst = work / f"{row}.gguf"
        if dst.is_file() or row == "float-f32":
            continue
        if row in LLAMA_ROWS:
            ftype, imatrix = LLAMA_ROWS[row]
            task = {"kind": "quantize", "src": str(f32), "dst": str(dst), "ftype": ftype,
                    "imatrix": json.loads(imatrix_path.read_text()) if imatrix else None}
            result = run_driver(python, {"model": None, "tasks": [task]})
            if result.get("error"):
                skipped[row] = f"llama.cpp: {result['error']}"
        elif row in SAME_CODES and (work / f"{SAME_CODES[row][0]}-out" / "config.json").is_file():
            from geminicompress.formats.gguf_export import GGUFOptions, export
            from geminicompress.models.demo import demo_gguf_path

            info = export(work / f"{SAME_CODES[row][0]}-out", GGUFOptions(asym=SAME_CODES[row][1]),
                          source_gguf=demo_gguf_path(), dest=dst)
            (work / f"{row}-out").mkdir(exist_ok=True)
            (work / f"{row}-out" / "report.json").write_text(json.dumps({"export": {"gguf": info}}))
        elif row.startswith("ours-gptq-auto-"):  # --gguf-type auto at the size of llama.cpp's file of that mix
            ref = work / f"llama-{row.removeprefix('ours-gptq-auto-')}-imatrix.gguf"
            if not ref.is_file():
                skipped[row] = f"needs {ref.name} first (its row before this one)"
                continue
            skipped.update(_ours(work, row, dst, ["--method", "gptq", "--gguf-type", "auto", "--target-size-mb",
                                                  f"{ref.stat().st_size / 1e6:.6f}", *CALIB]))
        elif not knows_gguf():
            skipped[row] = "this build's quantize has no --format gguf yet (issue #37's exporter)"
        else:
            skipped.update(_ours(work, row, dst, OURS_ROWS[row]))
    return skipped


def _ours(work: Path, row: str, dst: Path, args: list[str]) -> dict[str, str]:
    """Our quantize of the demo into WORK/ROW-out, its model.gguf moved to `dst`; {row: why} when it failed."""
    out = work / f"{row}-out"
    cmd = [sys.executable, "-m", "geminicompress", "quantize", "smollm2-demo", "-o", str(out),
           "--format", "gguf", "--force", "-q", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "model.gguf").is_file():
        return {row: (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    (out / "model.gguf").replace(dst)
    return {}


def linear_bits(path: Path) -> float:
    """Stored bits per weight of the decoder linears (blk.*.{attn,ffn}_*.weight), block scales included: the
    figure `eval --engine llama.cpp` reports (eval/engines/llama_eval.py), to 3 digits."""
    from geminicompress.eval.engines.llama_eval import linear_bits as bits

    return bits(path, digits=3)


def export_facts(out: Path) -> dict:
    """What OUT/report.json says of the GGUF our quantize wrote (types; Q4_1's rounded offset in steps)."""
    report = out / "report.json"
    info = json.loads(report.read_text()).get("export", {}).get("gguf", {}) if report.is_file() else {}
    return {k: info[k] for k in ("types", "q4_1_max_m_error_steps") if k in info}


def score(work: Path, rows: list[str], python: str, tokens: int, save=lambda rows: None, threads: int = 2,
          float_ppl: float | None = None, model: str = "smollm2-demo") -> list[dict]:
    """Score every row's file in llama.cpp, the F32 row first (the baseline of the KL and the drift); with
    `float_ppl` given (the F32 row's perplexity, scored before) the F32 row is not scored again and there is no
    KL; `save(rows so far)` after each row, so that an interrupted run keeps what it measured."""
    from geminicompress.eval.engines.llama_eval import TOP_K, quality_from_llama, run_driver
    from geminicompress.models.loading import load_model

    windows = eval_windows(load_model(model).tokenizer, tokens // 512)
    results, base = [], None
    cache = work / f"float-f32-scored-{tokens}.json"  # the F32 row's run, kept: later runs take their KL against it
    if float_ppl is None and cache.is_file():
        saved = json.loads(cache.read_text())
        base, float_ppl = saved["base"], saved["row"]["perplexity"]
        results.append({**saved["row"], "note": f"scored earlier ({cache.name})"})
    for row in [*(["float-f32"] if float_ppl is None else []), *[r for r in rows if r != "float-f32"]]:
        path = work / f"{row}.gguf"
        if not path.is_file():
            results.append({"row": row, "error": "not built"})
            continue
        task = {"kind": "logprobs", "windows": windows.tolist(), "top_k": TOP_K if row == "float-f32" else 0,
                "at": None if base is None else base["topk_ids"]}
        t0 = time.perf_counter()
        result = run_driver(python, {"model": str(path), "threads": threads, "n_ctx": 528, "tasks": [task]})
        if result.get("error"):
            results.append({"row": row, "error": result["error"]})
            continue
        q = quality_from_llama(result["tasks"][0], windows, base)
        if base is None and row == "float-f32":
            base = {**result["tasks"][0], "perplexity": q["perplexity"]}
            float_ppl = q["perplexity"]
        results.append({"row": row, **({"note": NOT_RANKED[row]} if row in NOT_RANKED else {}), "file_mb": round(path.stat().st_size / 1e6, 3), "linear_bits": linear_bits(path),
                        "perplexity": round(q["perplexity"], 3),
                        "drift_pct": round(100 * (q["perplexity"] / float_ppl - 1), 2) if float_ppl else None,
                        "kl_lower_bound": q["kl_to_baseline"] if base else None,
                        "top1_agreement": q["top1_agreement"] if base else None, "llama_cpp": result["llama_cpp"],
                        "score_s_shared_machine": round(time.perf_counter() - t0, 1),
                        **export_facts(work / f"{row}-out")})
        print(json.dumps(results[-1]), flush=True)
        if row == "float-f32" and base is not None:
            cache.write_text(json.dumps({"base": base, "row": results[-1]}))
        save(results)
    return results


def table(rows: list[dict]) -> str:
    lines = ["| row | bits/weight (linears) | file MB | perplexity | drift | KL (lower bound) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | | | {r['error']} | | |")
        else:
            kl = "" if r.get("kl_lower_bound") is None else f"{r['kl_lower_bound']:.4f}"
            drift = "" if r.get("drift_pct") is None else f"{r['drift_pct']:+.2f}%"
            note = "; ".join(x for x in (r.get("note"), r.get("q4_1_max_m_error_steps") and
                                         f"m rounded by <= {r['q4_1_max_m_error_steps']} of a step") if x)
            name = r["row"] + (f" ({note})" if note else "")
            lines.append(f"| {name} | {r['linear_bits']} | {r['file_mb']} | {r['perplexity']} | {drift} | {kl} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "geminicompress" / "gguf-bench"))
    ap.add_argument("--rows", default=",".join([*LLAMA_ROWS, *OURS_ROWS]), help="comma separated")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--score-only", action="store_true")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--name", default="gguf_bench")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--no-baseline", action="store_true", help="do not score the F32 row first: no KL, the drift "
                    "against the included F32 row")
    ap.add_argument("--include", default=None, help="a results JSON whose rows are listed first (scored before, "
                    "same protocol)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from geminicompress.host.machine import machine, versions

    work, rows, python = Path(args.work), [r for r in args.rows.split(",") if r], llama_python()
    skipped = {} if args.score_only else build(work, rows, python)
    for row, why in skipped.items():
        print(f"not built: {row}: {why}", flush=True)
    if args.build_only:
        return
    path = RESULTS / f"{args.name}.json"
    meta = {"benchmark": "gguf anchors in llama.cpp", "command": "python " + " ".join(sys.argv),
            "perplexity": f"llama.cpp, wikitext2-test.txt, first {args.tokens} tokens, 512-token windows, transformers "
                          "tokenizer ids",
            "imatrix": "mean x^2 per input channel, 32 x 512 enwiki-sample.txt windows (seed 0)",
            "machine": machine(), "versions": versions()}

    def save(rows: list[dict]) -> None:
        for r in rows:
            if r.get("error") == "not built" and r["row"] in skipped:
                r["error"] = f"not built: {skipped[r['row']]}"
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")

    before = json.loads(Path(args.include).read_text())["rows"] if args.include else []
    if args.include:
        meta["included"] = f"rows of {args.include} (scored earlier, same windows): {', '.join(r['row'] for r in before)}"
    f32 = next((r["perplexity"] for r in before if r["row"] == "float-f32"), None) if args.no_baseline else None
    if args.no_baseline and f32 is None:
        raise SystemExit("--no-baseline needs --include with a scored float-f32 row (the drift's reference)")
    scored = before + score(work, rows, python, args.tokens, lambda rows: save(before + rows), args.threads, f32)
    print(table(scored))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
