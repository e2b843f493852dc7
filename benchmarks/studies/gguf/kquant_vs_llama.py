"""Our K-quant / IQ4 round-to-nearest (core/kquant.py) against llama.cpp's own quantizer, tensor by tensor.

llama.cpp's `ggml_quantize_chunk` is called through ctypes from the libggml-base.so that llama-cpp-python ships
(--lib), on the same float rows with the same importance vector; both results are dequantized by `gguf.quants`.
Printed per type: the share of blocks whose bytes are identical, and each side's importance-weighted relative
error Σ c·(w − ŵ)² / Σ c·w² (c: the importance, 1 without). Matrices: Gaussian rows with heavy-tailed importance,
and, with --demo, the demo model's float down_proj of layers 0 and 15 (1536 wide) with importance from its
calibration Hessian diagonal.

  python benchmarks/studies/gguf/kquant_vs_llama.py [--demo] [--lib /root/venv-llama/lib/python3.11/site-packages/llama_cpp/lib]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from geminicompress.core.kgrid import KTYPES  # noqa: E402
from geminicompress.core.kquant import quantize  # noqa: E402
from geminicompress.formats.gguf_kpack import QTYPES, pack  # noqa: E402

LIB = "/root/venv-llama/lib/python3.11/site-packages/llama_cpp/lib"


def llama_quantize(lib: ctypes.CDLL, w: np.ndarray, name: str, imp: np.ndarray | None) -> np.ndarray:
    """llama.cpp's bytes for w (rows, cols) float32 as `name`, with the importance vector imp (cols,) or None."""
    t = KTYPES[name]
    rows, cols = w.shape
    out = np.zeros((rows, cols // t.super * t.block_bytes), dtype=np.uint8)
    src = np.ascontiguousarray(w, dtype=np.float32)
    qw = None if imp is None else np.ascontiguousarray(imp, dtype=np.float32)
    lib.ggml_quantize_init(int(QTYPES[name]))
    lib.ggml_quantize_chunk(int(QTYPES[name]), src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                            ctypes.c_int64(0), ctypes.c_int64(rows), ctypes.c_int64(cols),
                            None if qw is None else qw.ctypes.data_as(ctypes.c_void_p))
    return out


def compare(lib: ctypes.CDLL, label: str, w: np.ndarray, imp: np.ndarray | None) -> None:
    c = np.ones(w.shape[1], np.float32) if imp is None else imp
    den = float((c * w.astype(np.float64) ** 2).sum())
    for name in KTYPES:
        theirs = llama_quantize(lib, w, name, imp)
        ours = pack(quantize(w, name, imp))
        t = KTYPES[name]
        same = (theirs.reshape(-1, t.block_bytes) == ours.reshape(-1, t.block_bytes)).all(1).mean()
        err = [float((c * (quants.dequantize(b, QTYPES[name]).astype(np.float64) - w) ** 2).sum()) / den
               for b in (ours, theirs)]
        print(f"{label:28s} {name:7s} identical blocks {same:6.1%}  rel. error ours {err[0]:.5f} llama.cpp "
              f"{err[1]:.5f}  ({err[0] / err[1]:.3f}x)")


def demo_matrices() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The demo's down_proj of layers 0 and 15 and their inputs' mean square over a few calibration windows."""
    import torch

    from geminicompress.models.loading import load_model

    model, tok = load_model("smollm2-demo", torch.device("cpu"), torch.float32)
    text = (Path(__file__).resolve().parents[3].parent / "shared/data/enwiki-sample.txt").read_text()[:40000]
    ids = tok(text, return_tensors="pt").input_ids[:, :2048]
    found = []
    for i in (0, 15):
        lin = model.model.layers[i].mlp.down_proj
        acc = []
        h = lin.register_forward_hook(lambda m, a, o: acc.append(a[0].reshape(-1, a[0].shape[-1]).square().mean(0)))
        with torch.no_grad():
            model(ids)
        h.remove()
        found.append((f"demo layer {i} down_proj", lin.weight.detach().numpy().copy(), acc[0].numpy()))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=LIB)
    ap.add_argument("--demo", action="store_true")
    args = ap.parse_args()
    ctypes.CDLL(str(Path(args.lib) / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(Path(args.lib) / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 1024)) * 0.02).astype(np.float32)
    imp = (rng.random(1024) ** 4 + 1e-3).astype(np.float32)
    compare(lib, "gaussian 256x1024, imatrix", w, imp)
    compare(lib, "gaussian 256x1024, none", w, None)
    if args.demo:
        for label, w, imp in demo_matrices():
            compare(lib, label, w, imp)


if __name__ == "__main__":
    main()
