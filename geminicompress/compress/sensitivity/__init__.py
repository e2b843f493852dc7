"""Per-module sensitivity tables (measure.py), their options (options.py) and heat-map (plot.py)."""
