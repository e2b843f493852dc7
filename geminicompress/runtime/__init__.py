"""A run: its recipe (recipes/), the methods it may name (methods.py), the checks before any weight is read
(preflight.py), whether it streams and the walk of its stages (stages.py), the pipeline that writes OUT
(pipeline.py), the whole-model fallback (whole_model.py) and `tune`'s rounds (tune.py)."""
