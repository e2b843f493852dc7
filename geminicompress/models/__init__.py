"""Model loading (hub id, directory, .gguf, demo alias) and saving (the output-directory contract)."""

from geminicompress.models.loading import LoadedModel, ModelSource, load_model, resolve_model

__all__ = ["LoadedModel", "ModelSource", "load_model", "resolve_model"]
