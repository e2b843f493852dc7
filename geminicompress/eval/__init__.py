"""Evaluation: quality drift (perplexity, KL, agreement) against latency gain, one table and one chart."""
