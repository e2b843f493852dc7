"""geminicompress: quantize, prune and distill LLMs, then measure honestly what that bought."""

__version__ = "0.4.7"
