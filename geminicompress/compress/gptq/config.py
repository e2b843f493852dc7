"""The GPTQ stage's config and its mixed-precision allocation (its method class: method.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from geminicompress.core.config import Strict, WeightQuantStage
from geminicompress.core.gguf_config import AUTO, GGUF_HELP, GGUFFields

# the per-tensor types `--gguf-type auto` chooses from (compress/sensitivity/options.py: GGUF_TYPES)
GGUF_AUTO_OPTIONS = ["gguf:Q2_K", "gguf:Q3_K", "gguf:Q4_K", "gguf:Q5_K", "gguf:Q6_K", "gguf:IQ4_NL", "gguf:Q5_0",
                     "gguf:Q8_0"]


class QuantAllocation(Strict):
    """Mixed precision under a budget: a knapsack over a sensitivity table (compress/allocation.py).
    Give exactly one of target_bits, target_size_mb, max_drift."""

    options: list[str] = Field(default_factory=lambda: ["gptq:b4g64", "gptq:b3g64"],
                               description="the settings each module may get (gptq:b<bits>g<group>; with --gguf-type "
                               "auto GGUF types gguf:<TYPE>, default " + ",".join(GGUF_AUTO_OPTIONS) + ")")
    target_bits: float | None = Field(None, gt=0.0, description="average stored bits per quantized weight, scales "
                                      "and zero points included")
    target_size_mb: float | None = Field(None, gt=0.0, description="checkpoint size in MB (10^6 bytes; --gguf-type "
                                         "auto: the model.gguf file's)")
    max_drift: float | None = Field(None, gt=0.0, description="predicted perplexity drift in percent: the smallest "
                                    "allocation whose predicted exp(sum KL) - 1 stays under it")
    sensitivity: str | None = Field(None, description="a sensitivity.json (default: measure one on the calibration data)")
    measure: Literal["proxy", "kl"] = Field("proxy", description="how to measure when no table is given")
    kl_windows: int = Field(2, ge=1)
    fuse: bool = Field(False, description="one setting per group of linears reading one input (q/k/v, gate/up)")

    @model_validator(mode="after")
    def _one_target(self) -> "QuantAllocation":
        given = [k for k in ("target_bits", "target_size_mb", "max_drift") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of target_bits, target_size_mb, max_drift (got {', '.join(given) or 'none'})")
        bad = [o for o in self.options if not re.fullmatch(r"gptq:b\d+g-?\d+|gguf:\w+", o)]
        if bad:
            raise ValueError(f"allocation options of a gptq stage are gptq:b<bits>g<group> (or gguf:<TYPE> with "
                             f"--gguf-type auto), got {', '.join(bad)}")
        return self


class GPTQStage(WeightQuantStage, GGUFFields):
    """GPTQ (Frantar et al., 2022): Hessian-aware rounding, layer by layer."""

    method: Literal["gptq"]
    bits: Literal[2, 3, 4, 5, 8] = Field(4, description="weight bits: 2, 3, 4, 5 or 8 (5: --format gguf (Q5_0) or "
                                         "dense only)")
    sym: bool = Field(True, description="symmetric (default) or asymmetric with zero points",
                      json_schema_extra={"cli": "--sym/--asym"})
    # defaults measured on the demo model (docs/gptq.md, "Defaults, and why")
    act_order: Literal["none", "static", "group"] = Field(
        "static", description="column order: static (default): by decreasing Hessian diagonal, groups stay columns "
        "j // group-size, each group's scale decided from its updated weights when the solver reaches it; nothing "
        "permuted in the file, every loader reads it (vLLM included). group: groups formed in that order, g_idx "
        "stored (vLLM refuses it). none: stored order")
    true_sequential: bool = Field(True, description="quantize attention before MLP inside each layer (default on)")
    one_pass: bool = Field(True, description="true-sequential: one pass over the windows per layer (default; holds a "
                           "layer's activations for every window) or one pass per group of linears (less memory, "
                           "slower)", json_schema_extra={"cli": "--one-pass/--multi-pass"})
    damp: float = Field(0.01, gt=0.0, lt=1.0, description="dampening, fraction of the mean Hessian diagonal "
                        "(default 0.01)")
    first_token_weight: float = Field(16.0, ge=1.0, description="weight of each calibration window's first token "
                                      "(the attention sink) in the Hessians (default 16; 1 = every token alike)")
    block_size: int = Field(128, ge=1, description="columns per lazy-update block (default 128)")
    scale_search: Literal["auto", "none", "plain", "weighted", "trial"] = Field(
        "auto", description="each symmetric group's scale: none (the range's), or searched over shrink factors of it "
        "for the least rounding error, every column alike (plain) or weighted by the input's mean square like "
        "llama.cpp's importance matrix (weighted), decided when the solver reaches the group; trial: the weighted "
        "search's scale and every shrink factor each tried by solving the group's columns with GPTQ's feedback, "
        "each row keeping the least GPTQ loss (groups solved one after the other, in act order inside a group). "
        "auto (default): AUTO_GGUF for --format gguf, none otherwise")
    signed_scales: bool | None = Field(None, description="symmetric grids: map the largest-magnitude weight, with its "
                                       "sign, to the lowest code so the whole range is used (llama.cpp's Q4_0; the "
                                       "scale may be negative). Default: on for --format gguf, off otherwise")
    keep_zeros: bool = Field(False, description="on a pruned model: keep its zeros exactly (default off: GPTQ's error "
                             "feedback moves some off zero, which fits better; on the demo 68.2 vs 72.9 perplexity after "
                             "SparseGPT 50%); for a sparsity pattern a later tool needs")
    calib_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="float32 (default) or bfloat16: the dtype layers compute in while calibrating; the "
        "solver and the saved weights stay float32. bfloat16 is faster on GPUs and on CPUs with AVX512-BF16")
    format: Literal["gptq", "compressed-tensors", "dense", "gguf"] = Field(
        "gptq", description=f"on-disk format (default: the method's own); {GGUF_HELP}")
    allocation: QuantAllocation | None = Field(None, description="mixed precision: bits per module under a budget")
    overrides: dict[str, str] = Field(default_factory=dict, description="module name -> b<bits>g<group> "
                                      "(e.g. model.layers.0.self_attn.v_proj: b8g64); wins over the allocation")

    @model_validator(mode="before")
    @classmethod
    def _legacy_act_order(cls, data: Any) -> Any:
        """Recipes before act_order was a choice: true = group, false = none; static_groups: true = static."""
        if isinstance(data, dict) and (isinstance(data.get("act_order"), bool) or "static_groups" in data):
            data = dict(data)
            act, static = data.get("act_order"), data.pop("static_groups", False)
            if isinstance(act, bool):
                data["act_order"] = ("static" if static else "group") if act else "none"
            elif act is None and static:
                data["act_order"] = "static"
        return data

    @model_validator(mode="before")
    @classmethod
    def _auto_options(cls, data: Any) -> Any:
        """--gguf-type auto: the allocation chooses among GGUF types unless its options are given."""
        if (isinstance(data, dict) and str(data.get("gguf_type") or "").upper() == AUTO
                and isinstance(data.get("allocation"), dict) and "options" not in data["allocation"]):
            data = {**data, "allocation": {**data["allocation"], "options": list(GGUF_AUTO_OPTIONS)}}
        return data

    @model_validator(mode="after")
    def _auto_needs_budget(self) -> "GPTQStage":
        auto = self.gguf_type == AUTO
        if auto and self.allocation is None:
            raise ValueError("--gguf-type auto needs a budget: --target-size-mb MB (the GGUF file), --target-bits B "
                             "or --max-drift P%")
        if self.allocation is not None:
            kinds = {o.split(":", 1)[0] for o in self.allocation.options}
            if auto and kinds != {"gguf"}:
                raise ValueError(f"--gguf-type auto chooses GGUF types: options gguf:<TYPE>, got "
                                 f"{', '.join(self.allocation.options)}")
            if not auto and "gguf" in kinds:
                raise ValueError("gguf:<TYPE> allocation options need --format gguf --gguf-type auto")
            if self.gguf_type is not None and not auto:
                raise ValueError(f"--gguf-type {self.gguf_type} gives every tensor llama-quantize's type; mixed "
                                 "precision (--target-*) is --gguf-type auto")
        return self

    @model_validator(mode="after")
    def _search_needs_sym(self) -> "GPTQStage":
        if not self.sym and (self.scale_search not in ("auto", "none") or self.signed_scales):
            raise ValueError("scale_search and signed_scales apply to symmetric grids (--sym) only")
        return self

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [f"{k}: {s}" for k, s in v.items() if not re.fullmatch(r"b\d+g-?\d+", s)]
        if bad:
            raise ValueError(f"overrides are b<bits>g<group size>, e.g. b8g64; got {', '.join(bad)}")
        return v
