"""The recipe schema: a typed, validated description of a compression pipeline.

A recipe names a model, a seed, default calibration data, and an ordered list of stages. Each stage
is a pydantic model with `extra="forbid"`, so a typo in a key is an error naming the key. Stages are
told apart by `type` (and, for `quantize`, by `method`): see `stage_tag`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from geminicompress.core.config import Strict
from geminicompress.data.windows import Frame
from geminicompress.runtime.methods import METHODS, STAGE_TYPES, STAGES, method_of, stage_tag


class Calibration(Strict):
    """Calibration text shared by every stage that needs activations (GPTQ, AWQ, SmoothQuant, Wanda, SparseGPT)."""

    data: str = Field("builtin:pydoc", description="DATA: file, hub dataset (name:config:split) or builtin:pydoc")
    text_column: str = "text"
    samples: int = Field(128, ge=1, le=100_000, description="number of calibration windows")
    seq_len: int = Field(512, ge=8, le=131_072, description="tokens per calibration window")


# --------------------------------------------------------------------------- recipe


# Every stage's tag -> its config, from the registry.
STAGE_CONFIGS: dict[str, type[Strict]] = {tag: m.config for tag, m in STAGES.items()}

Stage = Annotated[
    Union[tuple(Annotated[cls, Tag(tag)] for tag, cls in STAGE_CONFIGS.items())],  # type: ignore[valid-type]
    Discriminator(
        stage_tag,
        custom_error_type="stage_type",
        custom_error_message=f"unknown stage: 'type' must be {', '.join(STAGE_TYPES)}, "
        f"and a quantize 'method' must be {', '.join(METHODS)}",
    ),
]


class Output(Strict):
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="dtype of float weights on disk")


class Recipe(Strict):
    description: str = ""
    model: str = Field(..., description="MODEL: hub id, local directory, .gguf file or smollm2-demo")
    seed: int = 0
    trust_remote_code: bool = False
    allow_pickle: bool = False
    allow_nonfinite: bool = Field(False, description="compress a model whose weights hold NaN/Inf anyway (by "
                                  "default that stops the run before any work; report.json records what was found)")
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads (default: the cores not busy "
                                "with other processes when the run starts); --threads overrides it")
    calibration: Calibration = Field(default_factory=Calibration)
    frame: Frame = Field("tokenizer", description="how every window the run builds starts (calibration, "
                         "distillation, eval): tokenizer: as the model's tokenizer starts a text (its BOS where it "
                         "adds one: Gemma, Llama 3, Mistral; nothing for SmolLM2, Qwen); text: text tokens only, "
                         "for text that is not a document start (data/windows.py)")
    stages: list[Stage] = Field(..., min_length=1)
    output: Output = Field(default_factory=Output)

    @model_validator(mode="after")
    def _eval_last(self) -> "Recipe":
        seen_eval = False
        for i, stage in enumerate(self.stages):
            if method_of(stage).kind == "eval":
                seen_eval = True
            elif seen_eval:
                raise ValueError(f"stage {i} ({stage.type}) comes after an eval stage; eval stages go last")
        return self
