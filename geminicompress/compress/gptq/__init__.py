"""GPTQ (Frantar et al., 2022): the solver (`solver.py`) and the layer-by-layer stage (`stage.py`)."""
