"""Evaluation: quality drift (perplexity, KL, agreement) against latency gain, one table and one chart.

Math (pure): `perplexity` (window NLL), `drift` (KL, top-1 agreement), `latency` (timed greedy
decoding), `footprint` (memory, size, params, sparsity). Plumbing: `baseline_cache` (the baseline's
log-probs per window), `quality` (the window loop), `extras` (lm-eval tasks, speculative decoding),
`api.evaluate` (used by the command and the stage), `table`/`report` (rich/markdown table, report
files, chart), `stage` (the recipe stage).
"""
