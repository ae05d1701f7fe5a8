"""Blocks of the model stages: the embedded pair's bootstrap, the pair, SLM finetuning, one-model evaluation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from citer.config.base import (
    _DEVICE,
    _DEVICE_RULE,
    DEVICE_STRATEGIES,
    Count0,
    Dropout,
    LearningRate,
    PosInt,
    Seed,
    WarmupRatio,
    WeightDecay,
    _Block,
    _FieldError,
)


class ArchParams(_Block):
    """A Qwen2-architecture model trained from scratch for the embedded pair.

    Attention heads split ``hidden_size`` evenly into heads of an even width (rotary embeddings rotate pairs), and
    key/value heads are shared by equal groups of attention heads.
    """

    hidden_size: PosInt
    intermediate_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt
    max_position_embeddings: PosInt = 512
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _heads_divide(self) -> ArchParams:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            raise _FieldError("num_attention_heads", heads, f"must divide hidden_size = {self.hidden_size}")
        if (self.hidden_size // heads) % 2:
            raise _FieldError(
                "num_attention_heads",
                heads,
                f"must leave an even head width: hidden_size {self.hidden_size} / {heads} is odd",
            )
        if heads % kv:
            raise _FieldError("num_key_value_heads", kv, f"must divide num_attention_heads = {heads}")
        return self


class PretrainParams(_Block):
    steps: PosInt
    lr: LearningRate
    batch_size: PosInt = 32
    warmup_ratio: WarmupRatio = 0.05
    weight_decay: WeightDecay = 0.01


class BootstrapParams(_Block):
    """``citer models bootstrap``: build the tokenizer and pretrain the embedded SLM base and LLM."""

    enabled: bool = True
    seed: Seed = 0
    vocab_size: int = Field(512, ge=258)  # the 256-byte alphabet, EOS and PAD, then merges
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
    device: str = "cpu"  # cpu, cuda, cuda:N, mps, or a device_map strategy (auto, ...)
    # Places the LLM with an accelerate device_map (module name -> device, or a strategy) while the SLM sits on
    # `device`: a large LLM split over GPUs. None: the LLM sits on `device` too.
    llm_device_map: (
        dict[str, str | int] | Literal["auto", "balanced", "balanced_low_0", "sequential"] | None
    ) = None
    trust_remote_code: bool = False

    @field_validator("device")
    @classmethod
    def _device_parses(cls, v: str) -> str:
        # Present-or-not (cuda on a CPU machine) is the loader's check; here only what torch could never parse.
        if v in DEVICE_STRATEGIES or _DEVICE.fullmatch(v):
            return v
        raise ValueError(_DEVICE_RULE)

    @field_validator("llm_device_map", mode="before")
    @classmethod
    def _map_devices_parse(cls, v: Any) -> Any:
        # Before the union is tried, so a bad value gets one line here, not one per member of the union.
        if v is None or v in DEVICE_STRATEGIES:
            return v
        if not isinstance(v, dict):
            raise ValueError(
                "must be null, a mapping of module -> device, or one of " + ", ".join(DEVICE_STRATEGIES)
            )
        for module, d in v.items():
            ok_index = isinstance(d, int) and not isinstance(d, bool) and d >= 0
            if not (ok_index or (isinstance(d, str) and (d == "disk" or _DEVICE.fullmatch(d)))):
                raise ValueError(
                    f"entry {module!r}: {d!r} must be a GPU index >= 0, cpu, cuda:N, mps or disk"
                )
        return v


class LoraParams(_Block):
    enabled: bool = False
    r: PosInt = 16
    alpha: PosInt = 32
    dropout: Dropout = 0.05
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class FinetuneParams(_Block):
    """SLM chain-of-thought SFT. Defaults are the CITER recipe for real pairs; params.yaml holds embedded values."""

    enabled: bool = True
    seed: Seed = 0
    lr: LearningRate = 2e-5
    weight_decay: WeightDecay = 0.01
    epochs: float = Field(10, gt=0.0)
    max_steps: int = -1  # -1: train for ``epochs``; else this many optimizer steps (>= 1)
    max_length: PosInt = 1000
    batch_size: PosInt = 8
    gradient_accumulation_steps: PosInt = 1
    warmup_ratio: WarmupRatio = 0.0
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    logging_steps: PosInt = 10
    bf16: bool = True
    deepspeed: bool = False
    deepspeed_config: str = "infra/deepspeed/zero2.json"
    lora: LoraParams = LoraParams()
    eval_examples: PosInt = 300  # dev rows decoded after training
    # Refuse to train when more than this share of rows would be cut at max_length (the cut rows teach no answer).
    max_truncated_fraction: float = Field(0.05, ge=0.0, le=1.0)

    @field_validator("max_steps")
    @classmethod
    def _steps_or_epochs(cls, v: int) -> int:
        if v == -1 or v >= 1:
            return v
        raise ValueError("must be -1 (train for epochs) or >= 1")


class EvalParams(_Block):
    """Greedy evaluation of one model alone (``citer eval model``)."""

    batch_size: PosInt = 64
    max_new_tokens: PosInt = 96
    n_examples: Count0 = 0  # first N test rows; 0 = all
    # The pipeline stops after eval_models when the LLM's test accuracy is at most chance + this (null: never).
    llm_chance_margin: float | None = Field(0.05, ge=0.0, le=1.0)
