"""Blocks of the data stages: paths, the dataset, the embedded task, validation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from citer.config.base import (
    PosInt,
    Seed,
    _Block,
    _FieldError,
)


class PathsParams(_Block):
    """Where stages read and write. Relative paths are resolved against the project directory."""

    data_dir: str = "data/embedded"
    models_dir: str = "models"
    labels_dir: str = "artifacts/labels"
    routers_dir: str = "artifacts/routers"
    reports_dir: str = "reports"
    outputs_dir: str = "outputs"
    mlflow_tracking_uri: str = "sqlite:///mlflow.db"
    mlflow_artifacts: str = "mlartifacts"


class DataParams(_Block):
    """The dataset the pipeline routes on. ``train``/``dev``/``test`` are JSONL files in the chosen format."""

    format: Literal["math", "mc"] = "math"
    train: str = "data/embedded/math_train.jsonl"
    dev: str = "data/embedded/math_dev.jsonl"
    test: str = "data/embedded/math_test.jsonl"


class SynthParams(_Block):
    """The embedded arithmetic task (``citer data synth``): sizes, difficulty and the variety of the references."""

    enabled: bool = True  # false when ``data`` points at real files: the pipeline then skips synth
    seed: Seed = 0
    n_train: PosInt = 6000
    n_dev: PosInt = 300
    n_test: PosInt = 300
    max_start: PosInt = 20
    max_operand: PosInt = 9
    max_total: PosInt = 40  # >= max_start + max_operand
    min_steps: PosInt = 2
    max_steps: PosInt = 3  # >= min_steps
    variety: float = Field(0.5, ge=0.0, le=1.0)
    n_choices: int = Field(4, ge=2, le=8)

    @model_validator(mode="after")
    def _consistent(self) -> SynthParams:
        if self.max_steps < self.min_steps:
            raise _FieldError("max_steps", self.max_steps, f"must be >= min_steps = {self.min_steps}")
        if self.max_total < self.max_start + self.max_operand:
            raise _FieldError(
                "max_total",
                self.max_total,
                f"must be >= max_start + max_operand = {self.max_start} + {self.max_operand}",
            )
        return self


class ValidateParams(_Block):
    """Files checked by the ``validate`` stage: pairs of (path, format). Empty means the ``data`` splits."""

    files: list[tuple[str, Literal["math", "mc"]]] = []
    max_chars_warning: PosInt = 20000
    # Share of rows with a defect (e.g. an empty \boxed{}) tolerated as warnings; above it the file is refused.
    # Great Expectations' ``mostly`` is 1 - this.
    max_bad_row_fraction: float = Field(0.001, ge=0.0, le=1.0)
