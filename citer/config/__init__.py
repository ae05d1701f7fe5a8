"""Typed view of ``params.yaml``: one pydantic model per pipeline stage.

Every stage reads its block through :func:`load_params`, so a misspelt key, a value of the wrong type or a value
out of its range fails before any work starts, with the dotted key, the value and the allowed range in one line
(``router.dropout: 1.5 is not allowed (must be >= 0 and < 1)``).

Every number has its range here: sizes, counts, steps and batch sizes >= 1 (>= 0 where 0 means "all" or "off"),
learning rates > 0, weight decays >= 0, dropouts and warmup ratios in [0, 1), shares and probabilities in [0, 1].
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from citer.config.base import DEVICE_STRATEGIES, ConfigError, Seed, _Block, _FieldError
from citer.config.data import DataParams, PathsParams, SynthParams, ValidateParams
from citer.config.evaluation import (
    IntervalParams,
    LockParams,
    ModelShapeParams,
    PriceAtParams,
    QueryRouterParams,
    RegistryParams,
    SelectionRule,
    StabilityParams,
    SweepParams,
    VerifySweepParams,
)
from citer.config.models import (
    ArchParams,
    BootstrapParams,
    EvalParams,
    FinetuneParams,
    LoraParams,
    ModelsParams,
    PretrainParams,
)
from citer.config.routing import LabelsParams, RouterParams
from citer.config.runtime import RuntimeParams
from citer.config.serving import EngineParams, InferenceParams, ServeParams

__all__ = [
    "DEVICE_STRATEGIES",
    "ArchParams",
    "BootstrapParams",
    "ConfigError",
    "DataParams",
    "EvalParams",
    "FinetuneParams",
    "EngineParams",
    "InferenceParams",
    "IntervalParams",
    "LabelsParams",
    "LockParams",
    "LoraParams",
    "ModelShapeParams",
    "ModelsParams",
    "Params",
    "PathsParams",
    "PretrainParams",
    "PriceAtParams",
    "QueryRouterParams",
    "RegistryParams",
    "RouterParams",
    "RuntimeParams",
    "SelectionRule",
    "ServeParams",
    "StabilityParams",
    "SweepParams",
    "VerifySweepParams",
    "SynthParams",
    "ValidateParams",
    "load_params",
    "resolve",
]


class Params(_Block):
    """The whole ``params.yaml``."""

    seed: Seed = 0
    paths: PathsParams = PathsParams()
    data: DataParams = DataParams()
    synth: SynthParams = SynthParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    bootstrap: BootstrapParams = BootstrapParams()
    models: ModelsParams = ModelsParams()
    finetune: FinetuneParams = FinetuneParams()
    eval: EvalParams = EvalParams()
    labels: LabelsParams = LabelsParams()
    router: RouterParams = RouterParams()
    runtime: RuntimeParams = Field(default_factory=RuntimeParams)  # per load: CITER_RUNTIME is read then
    sweep: SweepParams = SweepParams()
    stability: StabilityParams = StabilityParams()
    registry: RegistryParams = RegistryParams()
    lock: LockParams = LockParams()
    engine: EngineParams = EngineParams()
    inference: InferenceParams = InferenceParams()
    serve: ServeParams = ServeParams()

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)

    @model_validator(mode="after")
    def _embedded_pair_knows_the_format(self) -> Params:
        # The embedded pair is trained from scratch on bootstrap.formats only: asked another form it is at chance.
        if not self.bootstrap.enabled:
            return self
        used = {"data.format": self.data.format, "inference.format": self.inference.format}
        if self.serve.prompt_format in ("math", "mc"):
            used["serve.prompt_format"] = self.serve.prompt_format
        for key, fmt in used.items():
            if fmt is not None and fmt not in self.bootstrap.formats:
                raise _FieldError(
                    "bootstrap.formats",
                    self.bootstrap.formats,
                    f"must include {key} = {fmt!r}: the embedded pair learns only these forms",
                )
        return self


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _field_at(loc: tuple[Any, ...]) -> FieldInfo | None:
    """The field a pydantic error location points at (``("router", "dropout")``), None for a list item or an
    unknown key."""
    model: Any = Params
    info = None
    for part in loc:
        if model is None or not isinstance(part, str):
            return None
        info = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if info is None:
            return None
        ann = info.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return info


def _is_leaf(loc: tuple[Any, ...]) -> bool:
    """Whether ``loc`` is a field holding a value, not a whole block (a block's own check names its fields)."""
    info = _field_at(loc)
    ann = None if info is None else info.annotation
    return info is not None and not (isinstance(ann, type) and issubclass(ann, BaseModel))


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _range(loc: tuple[Any, ...], ctx: dict[str, Any]) -> str:
    """``must be >= 0 and < 1`` from the field's declared bounds (all of them, not only the one broken)."""
    info = _field_at(loc)
    bounds = dict(ctx)
    if info is not None:
        for m in info.metadata:
            for attr, _ in _BOUNDS:
                if getattr(m, attr, None) is not None:
                    bounds[attr] = getattr(m, attr)
    text = " and ".join(f"{op} {_num(bounds[attr])}" for attr, op in _BOUNDS if attr in bounds)
    if info is not None and type(None) in get_args(info.annotation):
        text += ", or null"
    return f"must be {text}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _error_line(e: Any) -> str:
    loc = tuple(e["loc"])
    value, ctx = e.get("input"), e.get("ctx") or {}
    err = ctx.get("error")
    if isinstance(err, _FieldError):  # a check across fields: name the field, not only its block
        loc, value, rule = (*loc, err.field), err.value, err.rule
    elif e["type"] in _RANGE_ERRORS:
        rule = _range(loc, ctx)
    elif e["type"] == "literal_error":
        rule = f"must be {ctx.get('expected', '')}"
    elif e["type"] == "value_error" and _is_leaf(loc):  # a field validator on this one value
        rule = str(err) if err is not None else e["msg"].removeprefix("Value error, ")
    else:
        rule = ""
    key = ".".join(str(p) for p in loc) or "<root>"
    if rule:
        return f"{key}: {_shown(value)} is not allowed ({rule})"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"{key}: {msg}{_did_you_mean(loc)}"
    if e["type"] == "missing" or isinstance(value, dict):
        return f"{key}: {msg}"  # a missing key, or a check over a whole block
    return f"{key}: {msg} (got {_shown(value)})"


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """`` (did you mean router.lr?)`` for an unknown key close to one its block has; empty when none is close."""
    import difflib

    model: Any = Params
    if loc[:-1]:
        parent = _field_at(loc[:-1])
        ann = None if parent is None else parent.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None or not isinstance(loc[-1], str):
        return ""
    names = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    return f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?)" if close else ""


def _format_error(path: Path, err: ValidationError) -> str:
    """One line: the file, then ``key: value is not allowed (range)`` (or pydantic's reason) for every bad key."""
    return f"{path}: invalid params -> " + "; ".join(_error_line(e) for e in err.errors())


def load_params(path: str | os.PathLike[str] = "params.yaml") -> Params:
    """Read and validate a params file. Raises :class:`ConfigError` naming the file and every bad key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: params file not found")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping of stage blocks")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(p, exc)) from exc


def resolve(root: str | os.PathLike[str], path: str) -> Path:
    """A params path made absolute against the project root (absolute paths and hub ids pass through)."""
    p = Path(path)
    return p if p.is_absolute() else Path(root) / p
