"""What every params block shares: the number types with their ranges, the device rule, the errors, the base model."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

PosInt = Annotated[int, Field(ge=1)]  # sizes, counts, steps, epochs, batch sizes
Count0 = Annotated[int, Field(ge=0)]  # a count where 0 means "all" (or "off")
Seed = Annotated[int, Field(ge=0)]
LearningRate = Annotated[float, Field(gt=0.0)]
WeightDecay = Annotated[float, Field(ge=0.0)]
Dropout = Annotated[float, Field(ge=0.0, lt=1.0)]
WarmupRatio = Annotated[float, Field(ge=0.0, lt=1.0)]

# What ``models.device`` may be: a torch device string, or an accelerate device_map strategy (the model is then
# placed by accelerate, see citer.models.loading.load_model). Parsed by pattern: torch is not imported here.
DEVICE_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?")
_DEVICE_RULE = "must be cpu, cuda, cuda:N, mps or a device_map strategy: " + ", ".join(DEVICE_STRATEGIES)


class ConfigError(ValueError):
    """A params file that cannot be used; the message names the file and the key."""


class _FieldError(ValueError):
    """A value refused by a check across fields of one block: names the field, the value and the rule, so the
    error line names ``block.field`` rather than only the block."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        super().__init__(f"{field}: {value!r} is not allowed ({rule})")
        self.field, self.value, self.rule = field, value, rule


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
