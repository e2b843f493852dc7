"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration").

search.py: the math (scale grid, clipping grid) as pure functions; compress/fold.py: folding scales and clips
into the model; results.py: the saved search (awq_search.safetensors); stage.py: the layer-by-layer
driver for `quantize --method awq|awq+gptq`. Packing to the AWQ GEMM layout: formats/awq.py.
"""
