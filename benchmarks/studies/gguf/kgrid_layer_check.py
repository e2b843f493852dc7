"""GPTQ on llama.cpp's K / IQ4 grids against llama.cpp's own rounding with an importance matrix, layer by layer on
the demo (light: seconds per layer, no lock needed).

For `mlp.down_proj` of layers 5 and 20 (1,536 wide: every K type) and `q_proj` of layer 5 (576: IQ4_NL only), the
Hessian H = 2/N Σ xᵀx of the layer's inputs over 8 × 512 enwiki-sample tokens; printed: GPTQ's output error
tr(ΔW H ΔWᵀ) (compress/gptq/kgrid_solve.py) over that of llama.cpp's rounding with the importance diag(H)/2, the
mean squared input (core/kquant.py, 98-100% byte-identical to llama.cpp's ggml_quantize_chunk).

  python benchmarks/studies/gguf/kgrid_layer_check.py
"""

import time

import torch

from geminicompress.compress.gptq.kgrid_solve import gptq_kquant
from geminicompress.core.kquant import quantize
from geminicompress.models.loading import load_model

LAYERS = [(5, "mlp.down_proj"), (5, "self_attn.q_proj"), (20, "mlp.down_proj")]


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model("smollm2-demo")
    model, tok = loaded.model, loaded.tokenizer
    text = open("/work/shared/data/enwiki-sample.txt").read()[:60000]
    ids = tok(text, return_tensors="pt").input_ids[:, :4096].reshape(8, 512)
    acts: dict = {}

    def hook(key):
        return lambda m, a, o: acts.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1]).float())

    hs = [model.model.layers[i].get_submodule(n).register_forward_hook(hook((i, n))) for i, n in LAYERS]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    for i, n in LAYERS:
        X = torch.cat(acts[(i, n)])
        H = 2 * X.T @ X / X.shape[0]
        W = model.model.layers[i].get_submodule(n).weight.detach().float()
        for name in (["Q2_K", "Q3_K", "Q4_K", "IQ4_XS", "IQ4_NL"] if W.shape[1] % 256 == 0 else ["IQ4_NL"]):
            t = time.time()
            codes, _ = gptq_kquant(W, H, name)
            t = time.time() - t
            ours = torch.from_numpy(codes.dequantize())
            rtn = torch.from_numpy(quantize(W.numpy(), name, (torch.diag(H) / 2).numpy()).dequantize())
            err = [float(torch.einsum("oi,ij,oj->", W - q, H, W - q)) for q in (ours, rtn)]
            print(f"layer {i} {n} {name}: GPTQ / llama.cpp output error {err[0] / err[1]:.3f} ({t:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
