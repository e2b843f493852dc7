"""The GGUF options a quantize stage takes with `format: gguf` (formats/gguf_export.py writes the file).

With `format: gguf` the stage writes OUT/model.gguf beside a GPTQ-format checkpoint (the checkpoint stays, so
OUT is verified and evaluated as always). A group size left at its default becomes 32: in GGUF a group of 64
costs the same bits as one of 32 (every 32-column block stores its scale)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from geminicompress.core.config import Strict

# llama-quantize's mixes written by --gguf-type (formats/gguf_mix.py: MIXES)
GGUF_MIXES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL",
              "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
AUTO = "AUTO"  # --gguf-type auto: per-tensor types by measured sensitivity under a size (gptq's allocation)
AUTO_BASE = "Q4_K_M"  # the mix whose rules type what auto does not choose: the token embedding, the output head

GGUF_HELP = ("gguf: OUT/model.gguf for llama.cpp/Ollama/LM Studio, beside a gptq checkpoint (the group size "
             "defaults to 32)")


class GGUFFields(Strict):
    """`gguf_*` options; each applies only with `format: gguf`."""

    gguf_asym: Literal["q5_0", "q4_1"] | None = Field(
        None, description="--format gguf: asymmetric (zero point) <= 4-bit codes as q5_0 (default; exact) or q4_1 "
        "(smaller; its fp16 offset is rounded, by at most ~0.007 of a step)")
    gguf_embeddings: Literal["q8_0", "f16", "f32"] | None = Field(
        None, description="--format gguf: token embeddings (and an untied float output head) as q8_0 (default), "
        "f16 or f32")
    gguf_float: Literal["f16", "f32"] | None = Field(
        None, description="--format gguf: float linears (not quantized) as f16 (default) or f32")
    gguf_type: Literal[(*GGUF_MIXES, AUTO)] | None = Field(  # type: ignore[valid-type]
        None, description="--format gguf: llama-quantize's mix (Q4_K_M, Q3_K_M, Q2_K, IQ4_NL, Q4_0, ...): every "
        "tensor gets the type llama.cpp's own file of that mix gives it, our codes in it; --bits and --group-size "
        "do not apply; the checkpoint beside model.gguf is dense (the GGUF's weights, dequantized). auto (gptq): "
        "each linear's type chosen by measured sensitivity to fit --target-size-mb (the file) or --target-bits")

    @model_validator(mode="before")
    @classmethod
    def _gguf_group(cls, data: Any) -> Any:
        """format gguf: the default group size is 32; a --gguf-type in any case."""
        if isinstance(data, dict) and isinstance(data.get("gguf_type"), str):
            data = {**data, "gguf_type": data["gguf_type"].upper()}
        if (isinstance(data, dict) and data.get("format") == "gguf" and "group_size" in cls.model_fields
                and data.get("group_size") in (None, "auto")):
            data = {**data, "group_size": 32}
        return data

    @model_validator(mode="after")
    def _gguf_options(self) -> GGUFFields:
        fmt = getattr(self, "format", None)
        given = [k for k in ("gguf_asym", "gguf_embeddings", "gguf_float", "gguf_type") if getattr(self, k) is not None]
        if given and fmt != "gguf":
            raise ValueError(f"{', '.join(given)} applies to format gguf only")
        if self.gguf_type is not None and getattr(self, "method", None) not in ("gptq", "rtn"):
            raise ValueError(f"--gguf-type is written by the gptq and rtn methods, not {getattr(self, 'method', '?')}")
        if self.gguf_type == AUTO and getattr(self, "method", None) != "gptq":
            raise ValueError("--gguf-type auto is chosen by gptq's allocation: use --method gptq")
        if fmt == "gguf" and self.gguf_type is not None:
            if getattr(self, "act_order", None) == "group":
                raise ValueError("--gguf-type keeps each block's columns under its scales: use act_order static or none")
            return self
        if fmt == "gguf":
            bits, sym = getattr(self, "bits", 8), getattr(self, "sym", not getattr(self, "zero_point", False))
            if bits >= 8 and not sym:
                raise ValueError("format gguf: asymmetric 8-bit codes have no exact GGUF type; use symmetric 8-bit "
                                 "or 4 bits with zero points")
            if getattr(self, "act_order", None) == "group":
                raise ValueError("format gguf needs each 32-column block under one scale: use act_order static or none")
        return self

    def gguf_options(self) -> dict[str, str]:
        """The options the export takes (formats/gguf_export.GGUFOptions), defaults filled."""
        return {"asym": self.gguf_asym or "q5_0", "embeddings": self.gguf_embeddings or "q8_0",
                "floats": self.gguf_float or "f16", "mix": self.gguf_type}
