"""Blocks of the sweep and promotion: the rule, the query router, intervals, the registry guard, the project lock."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from citer.config.base import (
    Seed,
    _Block,
)


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


class VerifySweepParams(_Block):
    """Verified routing in the sweep (:mod:`citer.decoding.verify`), chosen on dev in stages, never as a full product:

    1. ``rhos`` x ``fractions`` with no window (the final check as ``final``) for ``citer_verify`` (the router variant
       the rule chose on dev) and ``bild`` (the SLM's top probability as the trigger, no router: Kim et al. 2023);
    2. at each method's dev-chosen (fraction, ρ), every ``windows`` value, and the final check flipped; the rule
       picks the point of stage 1 or 2;
    3. test: each method's fraction curve at its dev-chosen ρ, W and final check.
    """

    enabled: bool = True
    rhos: list[float] = [1.0, 2.0, 4.0]
    fractions: list[float] = [0.02, 0.04, 0.06, 0.1]
    windows: list[int] = [4, 8]
    final: bool = True
    bild: bool = True

    @field_validator("rhos")
    @classmethod
    def _rhos(cls, v: list[float]) -> list[float]:
        if not v or any(not r >= 0 for r in v):
            raise ValueError(f"must be a non-empty list of numbers >= 0, got {v}")
        return v

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < f < 1.0 for f in v):
            raise ValueError(f"must be a non-empty list of values in (0, 1), got {v}")
        return v

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: list[int]) -> list[int]:
        if any(w < 1 for w in v):
            raise ValueError(f"windows are >= 1 (no window is stage 1), got {v}")
        return v


class ModelShapeParams(_Block):
    """A decoder's shapes as its config names them (a Qwen2/Llama-style model): enough to count the bytes one forward
    call reads, without the weights (:mod:`citer.evaluation.pricing`)."""

    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool
    attention_bias: bool = True  # Qwen2's q/k/v projections have biases; Llama's do not


class PriceAtParams(_Block):
    """The reference pair every sweep row is also priced at (``sweep.price_at``): the same calls, tokens, context
    lengths, rollbacks and check calls at this pair's weight and KV bytes, and each router at its own width on this
    SLM's hidden size, in ``dtype_bytes`` per element. Reported beside the measured bytes, labelled with ``name``."""

    name: str = "Qwen2-1.5B/Qwen2-72B bf16"
    dtype_bytes: int = Field(2, ge=1)
    # The real configs of Qwen/Qwen2-1.5B and Qwen/Qwen2-72B (config.json on the hub).
    slm: ModelShapeParams = ModelShapeParams(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    llm: ModelShapeParams = ModelShapeParams(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=152064,
        tie_word_embeddings=False,
    )


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
    batch_size: int = Field(64, ge=1)  # teacher-forced passes (router scores, oracle flags, query features)
    # Rows decoded at once in a decoding pass (None: batch_size). A row's tokens and its batch-1 bytes do not depend
    # on its batch, so this moves only wall time and the batch-shared columns (``bytes_moved_batch*``).
    decode_batch_size: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(96, ge=1)
    gpu: Literal["H100", "H200"] = "H100"
    seed: Seed = 0
    iter1: bool = True  # the iteration-1 router as its own method (labels.iterations >= 2)
    oracle: bool = True
    speculative: bool = True
    speculative_examples: int = Field(0, ge=0)
    speculative_tokens: int = Field(5, ge=1)
    query: QueryRouterParams = QueryRouterParams()
    verify: VerifySweepParams = VerifySweepParams()
    intervals: IntervalParams = IntervalParams()
    rule: SelectionRule = SelectionRule()
    price_at: PriceAtParams | None = PriceAtParams()  # null: no priced column

    @field_validator("llm_fractions")
    @classmethod
    def _fractions_in_range(cls, v: list[float]) -> list[float]:
        bad = [f for f in v if not 0.0 < f < 1.0]
        if bad or not v:
            raise ValueError(
                f"must be a non-empty list of values in (0, 1); outside: {bad or '(empty list)'}"
            )
        return v

    @property
    def decoding_batch(self) -> int:
        """Rows per decoding batch: ``decode_batch_size``, else ``batch_size``."""
        return self.decode_batch_size or self.batch_size


class StabilityParams(_Block):
    """``citer eval stability``: the routers retrained with ``seeds`` seeds in all (``router.seed`` and the next
    ``seeds - 1``; labels and models fixed), each seed through the whole sweep; every claim's spread across them."""

    seeds: int = Field(3, ge=2)


class RegistryParams(_Block):
    """The MLflow Model Registry side of the sweep and the guard on promotion.

    A candidate takes ``alias`` only when, on at least ``min_eval_examples`` test questions, it meets the rule, moves
    fewer bytes than LLM-only, and beats the champion re-evaluated on the same questions.
    """

    model_name: str = "citer-router"
    alias: str = "champion"
    experiment: str = "citer"
    min_eval_examples: int = Field(200, ge=1)


class LockParams(_Block):
    """The project lock (a file under ``.state/``) held by every stage that writes shared state: the registry and
    alias, ``reports/``, a route output. ``wait``: a second run waits up to ``timeout_s`` (with a message), else
    it refuses at once with one line."""

    wait: bool = True
    timeout_s: float = Field(3600.0, gt=0.0)
