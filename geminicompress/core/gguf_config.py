"""The GGUF options a quantize stage takes with `format: gguf` (formats/gguf_export.py writes the file).

With `format: gguf` the stage writes OUT/model.gguf beside a GPTQ-format checkpoint (the checkpoint stays, so
OUT is verified and evaluated as always). A group size left at its default becomes 32: in GGUF a group of 64
costs the same bits as one of 32 (every 32-column block stores its scale)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from geminicompress.core.config import Strict

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

    @model_validator(mode="before")
    @classmethod
    def _gguf_group(cls, data: Any) -> Any:
        """format gguf: the default group size is 32."""
        if isinstance(data, dict) and data.get("format") == "gguf" and "group_size" in cls.model_fields \
                and data.get("group_size") in (None, "auto"):
            data = {**data, "group_size": 32}
        return data

    @model_validator(mode="after")
    def _gguf_options(self) -> GGUFFields:
        fmt = getattr(self, "format", None)
        given = [k for k in ("gguf_asym", "gguf_embeddings", "gguf_float") if getattr(self, k) is not None]
        if given and fmt != "gguf":
            raise ValueError(f"{', '.join(given)} applies to format gguf only")
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
                "floats": self.gguf_float or "f16"}
