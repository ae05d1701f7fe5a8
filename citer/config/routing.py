"""Blocks of label collection and router training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from citer.config.base import (
    Count0,
    Dropout,
    LearningRate,
    PosInt,
    Seed,
    WeightDecay,
    _Block,
)


class LabelsParams(_Block):
    """Token-level preference collection. ``iterations`` counts label sets (1 = the ground-truth shortcut only)."""

    iterations: int = Field(2, ge=1)
    n_examples: Count0 = 0  # first N train rows; 0 = all
    batch_size: PosInt = 64
    max_new_tokens: PosInt = 96
    tau: float = Field(0.5, ge=0.0, le=1.0)
    rollout_llm_token: bool = False
    citer_s: bool = False
    hidden_dtype: Literal["float16", "float32"] = "float16"
    # Iteration-k rollouts with verified routing (citer.decoding.verify): the SLM's token is provisional, so a
    # catch-up may repair it and the label says whether the checked decoder ends right. None = off.
    verify_rho: float | None = Field(None, ge=0.0)
    verify_window: int = Field(0, ge=0)
    verify_final: bool = False

    @model_validator(mode="after")
    def _verify_needs_rho(self) -> LabelsParams:
        if self.verify_rho is None and (self.verify_window or self.verify_final):
            raise ValueError("verify_window/verify_final need verify_rho (rollouts without it check nothing)")
        return self

    @property
    def verify_kwargs(self) -> dict[str, float | int | bool] | None:
        """The rollout engine's verification arguments; None when off."""
        if self.verify_rho is None:
            return None
        return {
            "verify_rho": self.verify_rho,
            "verify_window": self.verify_window,
            "verify_final": self.verify_final,
        }

    @property
    def verify_meta(self) -> dict[str, dict[str, str]]:
        """What a label set records of its rollouts' verification (nothing when off)."""
        kw = self.verify_kwargs
        return {"rollout_verify": {k: str(v) for k, v in kw.items()}} if kw else {}


class RouterParams(_Block):
    """The MLP router (h -> 2h -> h -> 1 on D inputs) and its training.

    ``features``: what the router reads, all computed from the SLM's last hidden state (``hidden``, always), the
    input-embedding row of the SLM's greedy token (``token_embedding``) and the top-``logit_k`` log-probabilities,
    entropy and top-1/top-2 margin (``logit_stats``). ``ablations``: extra routers on the last iteration's labels
    with hidden + token_embedding (``emb``), hidden + logit_stats (``logits``) or all three (``emb_logits``).
    """

    lr: LearningRate = 1e-3
    weight_decay: WeightDecay = 0.01
    epochs: PosInt = 30
    batch_size: int = Field(512, ge=2)  # BatchNorm cannot train on a batch of one
    dropout: Dropout = 0.1
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    patience: PosInt = 5  # epochs without a better validation loss before stopping
    class_weights: bool = True
    seed: Seed = 0
    # A router below this validation AUC is refused: it is not written over the previous one.
    min_val_auc: float = Field(0.7, ge=0.0, le=1.0)
    features: list[Literal["hidden", "token_embedding", "logit_stats"]] = ["hidden"]
    logit_k: int = Field(4, ge=1)
    ablations: list[Literal["emb", "logits", "emb_logits"]] = []
    # Hidden layers, each width a multiple of the SLM's hidden size h (rounded, at least 1): [2, 1] is the paper's
    # h -> 2h -> h -> 1; [] a linear probe. Every router is trained at this width (iterations, CITER-S, ablations).
    layers: list[float] = [2.0, 1.0]
    # The CITER router (router.features, the last iteration's labels) at each of these widths too: the sweep picks
    # one on dev by the rule, its reads counted. [] = no grid (the last iteration's router at ``layers``).
    layers_grid: list[list[float]] = []

    @field_validator("layers")
    @classmethod
    def _widths_positive(cls, v: list[float]) -> list[float]:
        if any(not w > 0 for w in v):
            raise ValueError(f"widths are multiples of the hidden size > 0, got {v}")
        return v

    @field_validator("layers_grid")
    @classmethod
    def _grid_widths(cls, v: list[list[float]]) -> list[list[float]]:
        for layers in v:
            cls._widths_positive(layers)
        if len({tuple(x) for x in v}) != len(v):
            raise ValueError("lists a width twice")
        return v

    @field_validator("features")
    @classmethod
    def _features_hold_hidden(cls, v: list[str]) -> list[str]:
        if "hidden" not in v:
            raise ValueError("must contain 'hidden'")
        return v

    @field_validator("features", "ablations")
    @classmethod
    def _no_name_twice(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("lists a name twice")
        return v
