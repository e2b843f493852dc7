"""The base of every recipe section: strict pydantic models (a typo in a key is an error naming it)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


GroupSize = Union[Annotated[int, Field(ge=-1)], Literal["auto"]]
GROUP_SIZE_HELP = ("input columns sharing a scale; -1 or 0 = per output channel; default auto: the largest of 128, "
                   "64, 32 dividing every quantized layer's input features (printed, and recorded in report.json); "
                   "32 with --format gguf")


class StageBase(Strict):
    """What every stage accepts: its own DATA (calibration or training text), else the recipe's."""

    data: str | None = Field(None, description="calibration/training DATA for this stage (default: the recipe's)")
    makes_student: ClassVar[bool] = False  # its output is a smaller student model (distill), not the input changed


class WeightQuantStage(StageBase):
    """What the b-bit weight methods (rtn, gptq, awq, awq+gptq) share: the stage type, which linears, how
    many bits, how many input columns per scale. Each method narrows `method` to its own names and adds its
    options and its `format` choices."""

    type: Literal["quantize"] = "quantize"
    method: str
    bits: Literal[2, 3, 4, 8] = Field(4, description="weight bits: 2, 3, 4 or 8")
    group_size: GroupSize = Field("auto", description=GROUP_SIZE_HELP)
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="module name pattern (regex) to keep "
                              "in float; repeatable (default lm_head)")


def ignore_to_check(cfg: BaseModel) -> list[str]:
    """The stage's `ignore` patterns a run must find in the model: those beyond the stage's default list. A
    pattern the user adds and no module matches is almost always a typo (an error); a default one may be
    absent from a model (not every architecture names its head lm_head), and OUT/recipe.yaml lists the
    defaults, so a run of that file must not fail on them."""
    default = type(cfg).model_fields["ignore"].get_default(call_default_factory=True)
    return [p for p in cfg.ignore if p not in default]
