"""The prune stage's config (magnitude, Wanda, SparseGPT; its method: method.py)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from geminicompress.core.config import StageBase as _StageBase

_PATTERN = re.compile(r"^(\d+):(\d+)$")


class PruneStage(_StageBase):
    """Unstructured or N:M pruning: magnitude (global or per layer), Wanda, SparseGPT."""

    type: Literal["prune"]
    method: Literal["magnitude", "wanda", "sparsegpt"] = Field(
        "magnitude", description="magnitude (default), wanda or sparsegpt (the last two calibrate on --data)")
    sparsity: float = Field(0.4, ge=0.0, lt=1.0, description="fraction of prunable weights set to zero, in [0, 1) "
                            "(default 0.4)")
    scope: Literal["global", "layer"] = Field("global", description="global: one threshold over all layers (magnitude "
                                              "only, default); layer: the same sparsity in every layer")
    pattern: str | None = Field(None, description="N:M semi-structured sparsity, e.g. 2:4 (implies scope layer)")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head", "embed_tokens"], description="module name pattern "
                              "(regex) never pruned; repeatable (default lm_head, embed_tokens)")
    damp: float = Field(0.01, gt=0.0, lt=1.0, description="sparsegpt: dampening, fraction of the mean Hessian diagonal")
    block_size: int = Field(128, ge=1, description="sparsegpt: columns per block")
    true_sequential: bool | None = Field(None, description="wanda/sparsegpt: prune attention, then MLP, each from "
                                         "inputs through the already-pruned linears, in one pass per layer (default "
                                         "on); off: all from the dense layer (null for magnitude, which takes none)")
    format: Literal["dense", "compressed-tensors"] = Field("dense", description="dense (default; exact zeros) or "
                                                           "compressed-tensors (sparse-bitmask, smaller on disk)")
    allocation: Literal["uniform", "global", "owl", "sensitivity"] | None = Field(
        None, description="how the total sparsity is split over the linears: uniform (= scope layer), global "
        "(= scope global, magnitude only), owl (outlier-weighted per decoder layer, calibrated) or sensitivity "
        "(a knapsack over measured per-linear sensitivities); the total over the decoder linears is exact")
    owl_lambda: float = Field(0.08, ge=0.0, lt=1.0, description="owl: layer sparsities span target +- lambda")
    owl_threshold: float = Field(5.0, gt=0.0, description="owl: a score above this many times the layer's mean is an outlier")
    sensitivity: str | None = Field(None, description="allocation sensitivity: a sensitivity.json from `geminicompress "
                                    "sensitivity` to allocate from (default: measure one first, in memory)")

    @field_validator("pattern")
    @classmethod
    def _check_pattern(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = _PATTERN.match(v)
        if not m or not 0 < int(m.group(1)) < int(m.group(2)):
            raise ValueError(f"pattern must be N:M with 0 < N < M (e.g. 2:4), got '{v}'")
        return v

    @model_validator(mode="after")
    def _check_combination(self) -> "PruneStage":
        if self.allocation is not None:
            if self.pattern:
                raise ValueError("an N:M pattern fixes the sparsity of every group; it takes no allocation")
            if self.allocation == "global" and self.method != "magnitude":
                raise ValueError(f"allocation 'global' is one magnitude threshold; {self.method} prunes each layer")
            scope = "global" if self.allocation == "global" else "layer"
            if "scope" in self.model_fields_set and self.scope != scope:
                raise ValueError(f"allocation '{self.allocation}' contradicts scope '{self.scope}'; give one of them")
            object.__setattr__(self, "scope", scope)
        if self.sensitivity is not None and self.allocation != "sensitivity":
            raise ValueError("sensitivity (a table file) applies to allocation 'sensitivity' only")
        if self.method != "magnitude" and self.scope == "global":
            if "scope" in self.model_fields_set:
                raise ValueError(f"scope 'global' applies to magnitude pruning only; {self.method} prunes each layer")
            object.__setattr__(self, "scope", "layer")
        if self.pattern and self.scope == "global":
            if "scope" in self.model_fields_set:
                raise ValueError("an N:M pattern is per group of M weights; it cannot use scope 'global'")
            object.__setattr__(self, "scope", "layer")
        if self.method == "magnitude" and self.true_sequential is not None:
            raise ValueError("true_sequential applies to the calibrated methods (wanda, sparsegpt), not magnitude")
        if self.method != "magnitude" and self.true_sequential is None:
            object.__setattr__(self, "true_sequential", True)
        if self.pattern:
            n, m = (int(v) for v in self.pattern.split(":"))
            if "sparsity" in self.model_fields_set and abs(self.sparsity - n / m) > 1e-9:
                raise ValueError(f"pattern {self.pattern} prunes exactly {n}/{m} = {n / m:g} of the weights; "
                                 f"leave out sparsity (got {self.sparsity})")
            object.__setattr__(self, "sparsity", n / m)  # what the run does, so report.json and recipe.yaml say it
        return self
