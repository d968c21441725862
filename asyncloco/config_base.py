"""Strict pydantic base for every config section: unknown keys are errors, values are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """A config section. Unknown keys raise (typos never pass silently); instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
