"""Compression stages: `int8` (W8A16/W8A8), `gptq`, `awq`, `prune`. On-disk formats live in `geminicompress/formats/`."""
