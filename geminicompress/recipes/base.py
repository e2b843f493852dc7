"""The base of every recipe section: strict pydantic models (a typo in a key is an error naming it)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageBase(Strict):
    """What every stage accepts: its own DATA (calibration or training text), else the recipe's."""

    data: str | None = Field(None, description="calibration/training DATA for this stage (default: the recipe's)")


GroupSize = Union[Annotated[int, Field(ge=-1)], Literal["auto"]]
GROUP_SIZE_HELP = ("input columns per scale; -1 or 0 = per output channel; auto = the largest of 128, 64, 32 "
                   "dividing every quantized layer's input features")
