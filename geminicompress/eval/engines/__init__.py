"""Engines that run a model for eval: torch (this process; kernel choice), vLLM (a subprocess in its own venv)."""
