"""The base of every recipe section: strict pydantic models (a typo in a key is an error naming it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageBase(Strict):
    """What every stage accepts: its own DATA (calibration or training text), else the recipe's."""

    data: str | None = Field(None, description="calibration/training DATA for this stage (default: the recipe's)")
