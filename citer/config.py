"""Typed view of ``params.yaml``: one pydantic model per pipeline stage.

Every stage reads its block through :func:`load_params`, so a misspelt key or a value of the wrong type fails before
any work starts, with the dotted key in the message (``router.lr: Input should be a valid number``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A params file that cannot be used; the message names the file and the key."""


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


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
    seed: int = 0
    n_train: int = 6000
    n_dev: int = 300
    n_test: int = 300
    max_start: int = 20
    max_operand: int = 9
    max_total: int = 40
    min_steps: int = 2
    max_steps: int = 3
    variety: float = Field(0.5, ge=0.0, le=1.0)
    n_choices: int = Field(4, ge=2, le=8)


class ValidateParams(_Block):
    """Files checked by the ``validate`` stage: pairs of (path, format). Empty means the ``data`` splits."""

    files: list[tuple[str, Literal["math", "mc"]]] = []
    max_chars_warning: int = 20000
    # Share of rows with a defect (e.g. an empty \boxed{}) tolerated as warnings; above it the file is refused.
    # Great Expectations' ``mostly`` is 1 - this.
    max_bad_row_fraction: float = Field(0.001, ge=0.0, le=1.0)


class ArchParams(_Block):
    """A Qwen2-architecture model trained from scratch for the embedded pair."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


class PretrainParams(_Block):
    steps: int
    lr: float
    batch_size: int = 32
    warmup_ratio: float = 0.05
    weight_decay: float = 0.01


class BootstrapParams(_Block):
    """``citer models bootstrap``: build the tokenizer and pretrain the embedded SLM base and LLM."""

    enabled: bool = True
    seed: int = 0
    vocab_size: int = 512
    formats: list[Literal["math", "mc"]] = ["math"]
    slm: ArchParams = ArchParams(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    llm: ArchParams = ArchParams(
        hidden_size=96,
        intermediate_size=288,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    slm_pretrain: PretrainParams = PretrainParams(steps=800, lr=5e-3)
    llm_pretrain: PretrainParams = PretrainParams(steps=1200, lr=3e-3)


class ModelsParams(_Block):
    """The model pair. Hub ids or local directories; the embedded default points at what ``bootstrap`` writes."""

    slm: str = "models/slm_base"
    llm: str = "models/llm"
    finetuned_slm: str = "models/slm"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # Places the LLM with an accelerate device_map (module name -> device, or a strategy) while the SLM sits on
    # `device`: a large LLM split over GPUs. None: the LLM sits on `device` too.
    llm_device_map: (
        dict[str, str | int] | Literal["auto", "balanced", "balanced_low_0", "sequential"] | None
    ) = None
    trust_remote_code: bool = False


class LoraParams(_Block):
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class FinetuneParams(_Block):
    """SLM chain-of-thought SFT. Defaults are the CITER recipe for real pairs; params.yaml holds embedded values."""

    enabled: bool = True
    seed: int = 0
    lr: float = 2e-5
    weight_decay: float = 0.01
    epochs: float = 10
    max_steps: int = -1
    max_length: int = 1000
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    logging_steps: int = 10
    bf16: bool = True
    deepspeed: bool = False
    deepspeed_config: str = "infra/deepspeed/zero2.json"
    lora: LoraParams = LoraParams()
    eval_examples: int = 300
    # Refuse to train when more than this share of rows would be cut at max_length (the cut rows teach no answer).
    max_truncated_fraction: float = Field(0.05, ge=0.0, le=1.0)


class EvalParams(_Block):
    """Greedy evaluation of one model alone (``citer eval model``)."""

    batch_size: int = 64
    max_new_tokens: int = 96
    n_examples: int = 0


class LabelsParams(_Block):
    """Token-level preference collection. ``iterations`` counts label sets (1 = the ground-truth shortcut only)."""

    iterations: int = Field(2, ge=1)
    n_examples: int = 0
    batch_size: int = 64
    max_new_tokens: int = 96
    tau: float = Field(0.5, ge=0.0, le=1.0)
    rollout_llm_token: bool = False
    citer_s: bool = False
    hidden_dtype: Literal["float16", "float32"] = "float16"


class RouterParams(_Block):
    """The MLP router (h -> 2h -> h -> 1 on D inputs) and its training.

    ``features``: what the router reads, all computed from the SLM's last hidden state (``hidden``, always), the
    input-embedding row of the SLM's greedy token (``token_embedding``) and the top-``logit_k`` log-probabilities,
    entropy and top-1/top-2 margin (``logit_stats``). ``ablations``: extra routers on the last iteration's labels
    with hidden + token_embedding (``emb``), hidden + logit_stats (``logits``) or all three (``emb_logits``).
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    epochs: int = 30
    batch_size: int = 512
    dropout: float = 0.1
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    patience: int = 5
    class_weights: bool = True
    seed: int = 0
    features: list[Literal["hidden", "token_embedding", "logit_stats"]] = ["hidden"]
    logit_k: int = Field(4, ge=1)
    ablations: list[Literal["emb", "logits", "emb_logits"]] = []

    @model_validator(mode="after")
    def _features_hold_hidden(self) -> RouterParams:
        if "hidden" not in self.features:
            raise ValueError(f"features must contain 'hidden', got {self.features}")
        for name in ("features", "ablations"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} lists a name twice: {values}")
        return self


class SelectionRule(_Block):
    """How the sweep picks τ: least bytes at accuracy ≥ ratio × LLM-only, or most accuracy under a bytes budget."""

    kind: Literal["min_bytes_at_accuracy", "max_accuracy_under_bytes"] = "min_bytes_at_accuracy"
    accuracy_ratio: float = Field(0.98, gt=0.0, le=1.0)
    bytes_budget_rel_llm: float = Field(0.4, gt=0.0)


class QueryRouterParams(_Block):
    """The query-level baseline (RouteLLM's recipe): per-question labels on the train split (does the SLM alone answer
    correctly?), a logistic classifier on the SLM's mean hidden state over the prompt."""

    train_examples: int = Field(1000, ge=2)  # train rows decoded by the SLM alone to label them
    epochs: int = Field(300, ge=1)
    lr: float = Field(0.05, gt=0.0)
    weight_decay: float = Field(1e-3, ge=0.0)


class IntervalParams(_Block):
    """Paired bootstrap over the test questions: every row's accuracy and bytes and every claim get an interval."""

    resamples: int = Field(1000, ge=100)
    level: float = Field(0.95, gt=0.5, lt=1.0)


class SweepParams(_Block):
    """The evaluation sweep (``citer eval sweep``): every method chosen on ``dev``, reported on ``test``.

    Each threshold method (CITER routers, confidence, query) gets one operating point per ``llm_fractions`` value:
    the quantile of its own scores on dev at which that share of tokens (questions, for query) goes to the LLM, so all
    methods span the same cost range whatever their score scale. The rule picks each method's point on dev; test
    reports every point. Random routing sends each fraction at random; the oracle and speculative decoding are one
    point each, on test. ``speculative_examples`` (0 = all) bounds the assisted-generation questions.
    """

    llm_fractions: list[float] = [0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5]
    n_examples: int = Field(0, ge=0)  # per split; 0 = all
    batch_size: int = Field(64, ge=1)
    max_new_tokens: int = Field(96, ge=1)
    gpu: Literal["H100", "H200"] = "H100"
    seed: int = 0
    iter1: bool = True  # the iteration-1 router as its own method (labels.iterations >= 2)
    oracle: bool = True
    speculative: bool = True
    speculative_examples: int = Field(0, ge=0)
    speculative_tokens: int = Field(5, ge=1)
    query: QueryRouterParams = QueryRouterParams()
    intervals: IntervalParams = IntervalParams()
    rule: SelectionRule = SelectionRule()

    @model_validator(mode="after")
    def _fractions_in_range(self) -> SweepParams:
        bad = [f for f in self.llm_fractions if not 0.0 < f < 1.0]
        if bad or not self.llm_fractions:
            raise ValueError(f"llm_fractions must be a non-empty list of values in (0, 1), got {bad or '[]'}")
        return self


class RegistryParams(_Block):
    model_name: str = "citer-router"
    alias: str = "champion"
    experiment: str = "citer"


class InferenceParams(_Block):
    """``citer route``: the champion router over a JSONL of questions; rerunning resumes where it stopped."""

    input: str | None = None  # None: data.test, the split the sweep routed
    output: str = "outputs/predictions.jsonl"
    format: Literal["math", "mc"] | None = None  # None: data.format
    tau: float | None = Field(None, ge=0.0, le=1.0)  # None: the champion's tau tag
    # Ask for a share of tokens sent to the LLM instead of a raw τ (from the champion's dev score quantiles).
    llm_fraction: float | None = Field(None, ge=0.0, le=1.0)
    batch_size: int = Field(32, ge=1)
    max_new_tokens: int = Field(96, ge=1)


class ServeParams(_Block):
    """``citer serve``: the OpenAI-compatible endpoint in front of the registry's champion router."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_new_tokens: int = Field(128, ge=1)
    model_name: str = "citer"  # the OpenAI model id clients pass
    prompt_format: Literal["auto", "math", "mc", "raw"] = "auto"  # chat prompts; auto = data.format
    tau: float | None = Field(None, ge=0.0, le=1.0)  # None = the champion's τ
    llm_fraction: float | None = Field(None, ge=0.0, le=1.0)  # instead of tau: a target share of LLM tokens


class Params(_Block):
    """The whole ``params.yaml``."""

    seed: int = 0
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
    sweep: SweepParams = SweepParams()
    registry: RegistryParams = RegistryParams()
    inference: InferenceParams = InferenceParams()
    serve: ServeParams = ServeParams()

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)


def _format_error(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{key}: {e['msg']}")
    return f"{path}: invalid params -> " + "; ".join(lines)


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
