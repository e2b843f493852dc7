"""Pruning: global or per-layer magnitude, Wanda, SparseGPT; unstructured or N:M; dense or sparse-bitmask output.

- `threshold.py`: the k smallest of many tensors without concatenating them (global magnitude).
- `masks.py`: per-tensor, per-row and N:M keep-masks from a score.
- `wanda.py`, `sparsegpt.py`: the two calibration-based solvers (pure tensor math).
- `stage.py`: the pipeline stage (which weights, calibration, summary, masks file, exporter).
- `report.py`: the per-layer sparsity table and histogram.
(the compressed-tensors sparse-bitmask layout, written and read back: formats/sparse_bitmask.py)
"""
