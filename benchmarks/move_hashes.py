"""Hashes of what every command writes, so that a refactor can show it changed no byte (issue #27).

Runs, through the CLI (in this process, `--threads 2 --no-verify`), every bundled recipe and every method x
format x {in memory, streamed} on two models (on the demo, by default, one case of each method and format
family: DEMO_CASES), and prints one hash per output:
- `demo`: the demo model (smollm2-demo, float32, one file);
- `tiny`: a tiny Llama built in-process (seed 0), saved in bfloat16 as three shards.
Calibration is cut down so the whole sweep takes minutes, not hours (8 windows of 256 tokens of builtin text
on the demo, 8 x 64 on the tiny model; AWQ with a 2-point grid): it checks that bytes stay the same, not
quality. A case that is refused (e.g. an option that does not stream) hashes its one-line message instead.

What is hashed of an output directory: every safetensors tensor of the checkpoint (name, dtype, shape and
bytes, whatever the sharding), config.json's quantization_config and float dtype, quantize_config.json,
prune_masks.safetensors and awq_search/ (not report.json, recipe.yaml, plots or eval reports, which hold
timings).

  python benchmarks/move_hashes.py --out benchmarks/results/move_hashes.json          # record
  python benchmarks/move_hashes.py --check benchmarks/results/move_hashes.json       # compare, exit 1 on a change
  python benchmarks/move_hashes.py --models tiny --only gptq                          # a subset
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_name  # noqa: E402

CAL = {"demo": ["--samples", "8", "--calib-seq-len", "256"], "tiny": ["--samples", "8", "--calib-seq-len", "64"]}
AWQ = ["--n-grid", "2"]

# name -> (command, extra args); every case runs in memory and streamed
CASES: dict[str, tuple[str, list[str]]] = {
    "rtn-gptq": ("quantize", ["--method", "rtn", "--bits", "4"]),
    "rtn-ct": ("quantize", ["--method", "rtn", "--bits", "4", "--format", "compressed-tensors"]),
    "rtn-dense": ("quantize", ["--method", "rtn", "--bits", "3", "--format", "dense"]),
    "rtn-awq": ("quantize", ["--method", "rtn", "--asym", "--format", "awq"]),
    "int8": ("quantize", ["--method", "int8"]),
    "w8a8": ("quantize", ["--method", "w8a8"]),
    "w8a8-nosq": ("quantize", ["--method", "w8a8", "--smoothquant-alpha", "0"]),
    "gptq": ("quantize", ["--method", "gptq", "--bits", "4"]),
    "gptq-ct": ("quantize", ["--method", "gptq", "--bits", "4", "--format", "compressed-tensors"]),
    "gptq-dense": ("quantize", ["--method", "gptq", "--bits", "4", "--format", "dense"]),
    "gptq-3bit-noact": ("quantize", ["--method", "gptq", "--bits", "3", "--no-act-order", "--multi-pass"]),
    "gptq-pc-static": ("quantize", ["--method", "gptq", "--bits", "4", "--group-size", "-1", "--static-groups"]),
    "gptq-bf16calib": ("quantize", ["--method", "gptq", "--calib-dtype", "bfloat16"]),
    "awq": ("quantize", ["--method", "awq", *AWQ]),
    "awq-ct": ("quantize", ["--method", "awq", "--format", "compressed-tensors", *AWQ]),
    "awq-dense": ("quantize", ["--method", "awq", "--format", "dense", *AWQ]),
    "awq+gptq": ("quantize", ["--method", "awq+gptq", *AWQ]),
    "prune-global": ("prune", []),
    "prune-global-ct": ("prune", ["--format", "compressed-tensors"]),
    "prune-layer": ("prune", ["--scope", "layer", "--sparsity", "0.3"]),
    "prune-24-ct": ("prune", ["--pattern", "2:4", "--format", "compressed-tensors"]),
    "wanda": ("prune", ["--method", "wanda", "--sparsity", "0.5"]),
    "sparsegpt": ("prune", ["--method", "sparsegpt", "--sparsity", "0.5"]),
    "sparsegpt-24-ct": ("prune", ["--method", "sparsegpt", "--pattern", "2:4", "--format", "compressed-tensors"]),
    "prune-owl": ("prune", ["--method", "wanda", "--allocation", "owl"]),
    "gptq-override": ("quantize", ["--method", "gptq", "--bits", "4"]),  # + an override (set in main)
}
# on the demo model (minutes a case on 2 cores) a case of each method and format family, the chain and two
# recipes run by default; --all-demo runs every case there too
DEMO_CASES = ("rtn-gptq", "rtn-awq", "int8", "w8a8", "gptq", "gptq-ct", "gptq-dense", "awq", "prune-global",
              "prune-global-ct", "prune-24-ct", "wanda", "sparsegpt", "chain-sparsegpt-gptq", "recipe-quickstart")
# recipes run on both models (model overridden), cut down with --set
RECIPE_SETS = {
    "calibration.samples": "8",
    "calibration.data": "builtin:pydoc",
}
CHAIN = {"stages": [{"type": "prune", "method": "sparsegpt", "sparsity": 0.5},
                    {"type": "quantize", "method": "gptq", "bits": 4}]}
# distill with half its training text restyled (data/restyle.py), cut short: the restyled windows' bytes
RESTYLE = {"stages": [{"type": "distill", "student_layers": 0.5, "derive": "even", "repair": "none", "restyle": 0.5,
                       "steps": 3, "seq_len": 64, "eval_every": 3, "warmup_steps": 1, "eval_windows": 1}]}


def digest_output(out: Path) -> str:
    """One hash of what a checkpoint directory holds (see the module docstring)."""
    from safetensors import safe_open

    h = hashlib.sha256()
    files = sorted(p for p in out.rglob("*.safetensors"))
    tensors = []
    for f in files:
        rel = f.relative_to(out)
        group = "weights" if rel.parent == Path(".") and f.name != "prune_masks.safetensors" else str(rel)
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                tensors.append((group, key, st.get_tensor(key)))
    for group, key, t in sorted(tensors, key=lambda x: (x[0], x[1])):
        h.update(f"{group}|{key}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    config = json.loads((out / "config.json").read_text())
    meta = {"quantization_config": _strip(config.get("quantization_config")),
            "dtype": config.get("dtype") or config.get("torch_dtype")}
    h.update(json.dumps(meta, sort_keys=True).encode())
    qc = out / "quantize_config.json"
    if qc.is_file():
        h.update(json.dumps(_strip(json.loads(qc.read_text())), sort_keys=True).encode())
    return h.hexdigest()[:20]


def _strip(qc):
    """A quantization_config without the writer's version stamp."""
    if not isinstance(qc, dict):
        return qc
    return {k: v for k, v in qc.items() if k != "meta"}


def make_tiny(path: Path) -> Path:
    """The tiny model: Llama, 2 layers, bfloat16, three shards."""
    from tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama", seed=0).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) >= 3, "the tiny model is meant to be sharded"
    return path


def run_cli(args: list[str]) -> tuple[int, str]:
    from typer.testing import CliRunner

    from geminicompress.cli import app

    result = CliRunner().invoke(app, args)
    return result.exit_code, (result.output or "") + (str(result.exception) if result.exit_code and result.exception else "")


def one(args: list[str], out: Path) -> tuple[str, str]:
    """(hash, the refusal line or "")."""
    code, text = run_cli([*args, "-o", str(out), "--threads", "2", "--no-verify", "--quiet", "--force"])
    if code != 0:
        lines = [line for line in text.splitlines() if "error" in line.lower()] or text.splitlines()[-1:]
        line = (lines[0] if lines else str(code)).replace(str(out.parent.parent), "WORK")  # no temp paths in hashes
        return "refused:" + hashlib.sha256(line.encode()).hexdigest()[:12], line
    return digest_output(out), ""


def cases_for(model: str, path: str, work: Path, only: list[str], everything: bool = False) -> list[tuple[str, list[str]]]:
    from geminicompress.runtime.recipes.loader import bundled_recipes

    runs = []
    for name, (command, extra) in CASES.items():
        args = [command, path, *extra, *(CAL[model] if command in ("quantize", "prune") else [])]
        if name == "gptq-override":
            layer0 = "model.layers.0.self_attn.v_proj"
            recipe = work / f"override-{model}.yaml"
            recipe.write_text(json.dumps({"model": path, "calibration": _cal(model), "stages": [
                {"type": "quantize", "method": "gptq", "bits": 4, "overrides": {layer0: "b8g32"}}]}))
            args = ["run", str(recipe)]
        runs.append((name, args))
    chain = work / f"chain-{model}.yaml"
    chain.write_text(json.dumps({"model": path, "calibration": _cal(model), **CHAIN}))
    runs.append(("chain-sparsegpt-gptq", ["run", str(chain)]))
    restyle = work / f"restyle-{model}.yaml"
    restyle.write_text(json.dumps({"model": path, "calibration": _cal(model), **RESTYLE}))
    runs.append(("distill-restyle", ["run", str(restyle)]))
    for name in bundled_recipes():
        sets = [f"{k}={v}" for k, v in {**RECIPE_SETS, "model": path,
                                         "calibration.seq_len": _cal(model)["seq_len"]}.items()]
        runs.append((f"recipe-{name}", ["run", name, *[a for s in sets for a in ("--set", s)], *_recipe_cuts(name)]))
    if model == "demo" and not everything:
        runs = [(n, a) for n, a in runs if n in DEMO_CASES]
    return [(n, a) for n, a in runs if not only or any(o in n for o in only)]


def _cal(model: str) -> dict:
    return {"data": "builtin:pydoc", "samples": 8, "seq_len": 256 if model == "demo" else 64}


def _recipe_cuts(name: str) -> list[str]:
    """--set overrides that keep a bundled recipe short: few training steps, a quality-only short eval."""
    from geminicompress.runtime.recipes.loader import bundled_recipes, read_yaml

    data = read_yaml(bundled_recipes()[name])
    sets = []
    for i, stage in enumerate(data["stages"]):
        if stage["type"] == "distill":
            sets += [f"stages.{i}.steps=3", f"stages.{i}.eval_every=3", f"stages.{i}.save_every=0",
                     f"stages.{i}.seq_len=64", f"stages.{i}.warmup_steps=1", f"stages.{i}.eval_windows=1"]
        if stage["type"] == "eval":
            sets += [f"stages.{i}.latency=false", f"stages.{i}.max_tokens=1024", f"stages.{i}.seq_len=256"]
        if stage.get("method") == "awq":
            sets += [f"stages.{i}.n_grid=2"]
    return [a for s in sets for a in ("--set", s)]


def float32_training() -> None:
    """`precision: auto` (distill's default) trains in bf16 where the CPU multiplies it natively (AVX-512 BF16,
    AMX) and in float32 elsewhere, so a distill recipe's bytes would depend on the machine. The hashes are made
    as on a CPU without bf16: the same on every machine."""
    from geminicompress.distill import precision

    precision.native_bf16 = lambda device: False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,demo")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    parser.add_argument("--modes", default="memory,stream")
    parser.add_argument("--out", type=Path, default=None, help="write the hashes here (JSON)")
    parser.add_argument("--check", type=Path, default=None, help="compare with these hashes; exit 1 on a difference")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--all-demo", action="store_true", help="every case on the demo model too, not only DEMO_CASES")
    parser.add_argument("--resume", type=Path, default=None, help="a JSON of hashes already made: skip those cases")
    args = parser.parse_args()
    torch.set_num_threads(2)
    float32_training()
    work = args.work or Path(tempfile.mkdtemp(prefix="move-hashes-"))
    (work / "out").mkdir(parents=True, exist_ok=True)
    paths = {"demo": "smollm2-demo", "tiny": str(make_tiny(work / "tiny-model"))}
    only = [o for o in args.only.split(",") if o]
    recorded = json.loads(args.check.read_text()) if args.check else {}
    expected = recorded.get("hashes", {})
    if args.check and (recorded.get("cpu"), recorded.get("torch")) != (cpu_name(), torch.__version__):
        print(f"note: {args.check.name} was recorded on {recorded.get('cpu') or 'an unrecorded CPU'} with torch "
              f"{recorded.get('torch')}; this is {cpu_name()} with torch {torch.__version__}: float products differ by "
              "CPU, so compare with the base commit run here (docs/development.md)", flush=True)
    hashes: dict[str, str] = json.loads(args.resume.read_text())["hashes"] if args.resume and args.resume.is_file() else {}
    changed = []
    started = time.perf_counter()
    for model in args.models.split(","):
        for name, cli in cases_for(model, paths[model], work, only, args.all_demo):
            for mode in args.modes.split(","):
                key = f"{model}/{name}/{mode}"
                if key in hashes:
                    continue
                out = work / "out" / key.replace("/", "_")
                t0 = time.perf_counter()
                digest, why = one([*cli, "--stream" if mode == "stream" else "--no-stream"], out)
                shutil.rmtree(out, ignore_errors=True)
                hashes[key] = digest
                mark = ""
                if key in expected and expected[key] != digest:
                    changed.append(key)
                    mark = f"  CHANGED (was {expected[key]})"
                print(f"{key:48s} {digest}  {time.perf_counter() - t0:6.1f} s{mark}{'  ' + why if why else ''}", flush=True)
                if args.out:  # after every case: a killed sweep resumes with --resume
                    _save(args.out, hashes)
    print(f"{len(hashes)} outputs in {time.perf_counter() - started:.0f} s; {len(changed)} changed")
    if args.out:
        _save(args.out, hashes)
    return 1 if changed else 0


def _save(path: Path, hashes: dict[str, str]) -> None:
    import subprocess

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    path.write_text(json.dumps({"commit": commit, "torch": torch.__version__, "cpu": cpu_name(), "hashes": hashes},
                               indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
