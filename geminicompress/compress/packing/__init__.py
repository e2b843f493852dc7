"""Packing quantized weights into on-disk formats and loading them back.

- `bits.py`: dense little-endian bit streams of b-bit codes in int32 words (shared by every format).
- `gptq.py`: GPTQ v1 (`qweight`/`qzeros`/`scales`/`g_idx`), what transformers+GPTQModel and vLLM read.
- `compressed_tensors.py`: compressed-tensors `pack-quantized`, what vLLM and llm-compressor read.
- `qlinear.py`: the dequantizing linear our loaders put in place of quantized layers.
- `export.py`: `export_quantized(...)`, writing a checkpoint in one of those formats (or dense).
"""
