"""Compression stages: `int8` (W8A16/W8A8), `gptq`, `awq`, `prune`; `packing` holds the on-disk formats."""
