"""A run: its recipe (recipes/), the methods it may name (methods.py), its plan, made once before any weight is
read (plan.py: MODEL resolved, the checks, whole model or layers, streamed or in memory), the walk of its stages
(stages.py), the pipeline that writes OUT (pipeline.py), the whole-model pass (whole_model.py) and `tune`'s
rounds (tune.py)."""
