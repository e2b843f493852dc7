"""llama.cpp's perplexity of each GGUF file against our torch eval of the same codes (issue #63's bar: within 0.5%).

Reads the scored rows of `benchmarks/reproduce/gguf_gemma_bos.py` (WORK/kl.json: each file and llama.cpp's
perplexity of it) and the windows it scored (WORK/windows.json), loads every file into torch through our GGUF
loader (every tensor dequantized by `gguf.quants`, bit for bit the file's codes) and takes our perplexity on the
same windows (eval/quality/perplexity.py, float32):

  python benchmarks/reproduce/gguf_torch_check.py --work /work/runs/gguf-demo --name gguf_torch_check_demo
Prints one line per file and writes benchmarks/results/NAME.json.

`--activations q8` also scores each file in torch with the input of every linear rounded as llama.cpp's CPU
kernels round it before a quantized dot product (ggml's `vec_dot_type`): Q8_0 (blocks of 32, scale amax/127
held in fp16) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL weights, Q8_K (blocks of 256, float scale max/-127 of the
signed extreme) for the K types and IQ4_XS; float weights (F32/F16) take their input as it is. The weights are
the file's codes either way: a gap that closes under `q8` is llama.cpp's activation rounding, not the file.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, perplexity  # noqa: E402


Q8_0_INPUT = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}  # ggml-cpu's vec_dot_type: Q8_0 (Q8_1: same codes)
Q8_K_INPUT = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) rounded as ggml's quantize_row_q8_0: per 32 values d = amax/127, q = round(x/d) (x86's AVX2 kernel
    multiplies by 127/amax: the same codes but at a rounding tie), x = q * fp16(d)."""
    b = x.float().unflatten(-1, (-1, 32))
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / d.clamp_min(1e-30)), torch.zeros_like(b))
    return (q * d.half().float()).flatten(-2).to(x.dtype)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) rounded as ggml's quantize_row_q8_K: per 256 values iscale = -127/max (max the signed value of
    largest magnitude), q = min(127, round(iscale * x)), x = q / iscale."""
    b = x.float().unflatten(-1, (-1, 256))
    idx = b.abs().argmax(-1, keepdim=True)
    mx = b.gather(-1, idx)
    iscale = torch.where(mx != 0, -127 / mx, torch.zeros_like(mx))
    q = torch.round(iscale * b).clamp(max=127)
    return torch.where(mx != 0, q / iscale, torch.zeros_like(b)).flatten(-2).to(x.dtype)


def tensor_types(path: str) -> dict[str, str]:
    """GGUF tensor name -> its type's name."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def gguf_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """GGUF tensor name -> the model's linear holding it, through the name map our GGUF writer uses
    (gguf.get_tensor_name_map for the model's architecture); a tied head is named token_embd.weight."""
    import gguf

    from geminicompress.formats.gguf_export import gguf_arch

    config = model.config.to_dict()
    names = gguf.get_tensor_name_map(gguf_arch(config).arch, config["num_hidden_layers"])
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            gguf_name = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
            if gguf_name is not None:
                found[gguf_name] = module
    head = model.get_output_embeddings()
    found.setdefault("output.weight", head)
    if config.get("tie_word_embeddings"):
        found["token_embd.weight"] = head  # a tied head multiplies with the embedding's codes
    return found


def round_inputs_as_llama(model: torch.nn.Module, path: str) -> int:
    """Hook every linear of `model` (loaded from GGUF `path`) to round its input as llama.cpp does for its weight's
    type; returns how many linears were hooked."""
    types, hooked, modules = tensor_types(path), 0, gguf_modules(model)
    for name, ttype in types.items():
        if name not in modules or (name == "token_embd.weight" and "output.weight" in types):
            continue
        fn = q8_0 if ttype in Q8_0_INPUT else q8_k if ttype in Q8_K_INPUT else None
        if fn is not None:
            modules[name].register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]), *args[1:]))
            hooked += 1
    return hooked


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="gguf_gemma_bos.py's work folder (kl.json, windows.json)")
    ap.add_argument("--scored", default="", help="the scored rows (default WORK/kl.json, which each run rewrites)")
    ap.add_argument("--rows", default="", help="rows of kl.json to check, comma separated (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", choices=("float", "q8"), default="float",
                    help="q8: also score with every linear's input rounded as llama.cpp rounds it (module docstring)")
    ap.add_argument("--name", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from geminicompress.host.machine import machine, versions
    from geminicompress.models.loading import load_model

    work = Path(args.work)
    scored = json.loads(Path(args.scored or work / "kl.json").read_text())
    windows = torch.tensor(json.loads((work / "windows.json").read_text())["windows"])
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = []
    for r in scored["rows"]:
        if wanted and r["row"] not in wanted:
            continue
        path = r.get("file") or str(work / "float-f32.gguf")
        model = load_model(path).model.eval()  # float32: every tensor dequantized by gguf.quants
        ours = perplexity(model, windows)
        rel = (r["perplexity"] - ours) / ours
        row = {"row": r["row"], "file": path, "llama_cpp_ppl": r["perplexity"], "torch_ppl": round(ours, 4),
               "rel_diff": round(rel, 6)}
        line = f"{r['row']:28s} llama.cpp {r['perplexity']:9.4f}  torch {ours:9.4f}  {100 * rel:+.3f}%"
        if args.activations == "q8":
            row["hooked_linears"] = round_inputs_as_llama(model, path)
            q8 = perplexity(model, windows) if row["hooked_linears"] else ours  # a float file: nothing rounded
            row.update({"torch_q8_ppl": round(q8, 4), "rel_diff_q8": round((r["perplexity"] - q8) / q8, 6)})
            line += f"   torch, inputs as llama.cpp rounds them {q8:9.4f}  {100 * row['rel_diff_q8']:+.3f}%"
        del model
        gc.collect()
        rows.append(row)
        print(line, flush=True)
    out = {"benchmark": "llama.cpp's perplexity of each GGUF file against our torch eval of the same codes",
           "command": "python " + " ".join(sys.argv), "windows": list(windows.shape), "rows": rows,
           "max_abs_rel_diff": max(abs(r["rel_diff"]) for r in rows),
           **({"max_abs_rel_diff_q8": max(abs(r["rel_diff_q8"]) for r in rows)} if args.activations == "q8" else {}),
           "machine": machine(), "versions": versions()}
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
