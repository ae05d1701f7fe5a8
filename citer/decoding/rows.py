"""What a decoding session is made of: the engine it needs, the rows it decodes, the tokens it emits.

Shapes: k = rows, V = vocab.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from citer.decoding.call_rule import CallRule, StepTimes
from citer.decoding.choice import TopLogprobs
from citer.decoding.cost import ModelCost
from citer.decoding.decide import Sampling
from citer.decoding.verify import Verification


class Engine(Protocol):
    """What a session needs of :class:`~citer.decoding.engine.RoutedEngine` (which builds sessions)."""

    slm: nn.Module
    llm: nn.Module | None
    tau: float
    eos: set[int]
    vocab_size: int
    gpu: str
    cost_slm: ModelCost
    cost_llm: ModelCost | None
    call_rule: CallRule
    times: StepTimes
    llm_prefill: str
    overlap: bool
    verify: Verification
    slm_runner: Any  # citer.decoding.runner.ModelRunner: how each model's calls run
    llm_runner: Any

    def check_prompts(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None: ...

    def route(self, hidden: torch.Tensor, row_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor: ...

    def static_for(self, which: str) -> Any: ...

    def pools_for(self, session: object) -> tuple[Any, Any]: ...

    def decision(self, sampling: tuple[float, float, int]) -> Any: ...


class EngineInputError(ValueError):
    """Bad arguments to the engine; raised before any generation."""


def check_prompts(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    row_ids: Sequence[int] | None,
    vocab: int,
    limits: Sequence[tuple[str, int]],
) -> None:
    """Raise :class:`EngineInputError` for prompts or a budget models cannot take: ids outside ``[0, vocab)``, a
    prompt plus ``max_new_tokens`` beyond a model's positions (``limits``: (name, max positions))."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if len(prompts) == 0:
        raise EngineInputError("prompts: empty list, nothing to generate")
    if row_ids is not None and (len(row_ids) != len(prompts) or len(set(row_ids)) != len(row_ids)):
        raise EngineInputError(f"row_ids: need {len(prompts)} distinct ids, got {list(row_ids)[:8]}...")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise EngineInputError(f"prompts[{i}]: empty prompt")
        # Plain ints in range, checked in C (min/max); anything else gets the per-token look that names it.
        if all(type(t) is int for t in p) and 0 <= min(p) and max(p) < vocab:
            bad = []
        else:
            bad = [t for t in p if not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompts[{i}]: token ids outside [0, {vocab}): {bad[:5]}")
        for name, mx in limits:
            if len(p) > mx - max_new_tokens:
                raise EngineInputError(
                    f"prompts[{i}]: {len(p)} tokens is longer than the {name} context allows "
                    f"(max_position_embeddings {mx} - max_new_tokens {max_new_tokens} = {mx - max_new_tokens})"
                )


def check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0.0 or not 0.0 < top_p <= 1.0:
        raise EngineInputError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")


@dataclass
class Emitted:
    """One token chosen at a step for the row ``key``; ``done``: the row has finished and left the batch.

    For a row added with ``logprobs=k``: ``logprob``, the token's log-probability under the distribution of the model
    that wrote it (temperature 1, over the shared vocabulary), and ``top_logprobs``, that distribution's ``k``
    likeliest ``(token, logprob)`` (``k`` = 0: none). Other rows leave both None. ``replaced``: the provisional SLM
    tokens this (LLM) token took back, in order (verified routing); None when it took none back."""

    key: int
    token: int
    from_llm: bool
    done: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    replaced: list[int] | None = None


@dataclass
class Row:
    key: int  # the caller's handle; also the meter's row index
    row_id: int  # keys the random router and the sampler
    seq: list[int]
    prompt_len: int
    max_new: int
    sampling: Sampling = (0.0, 1.0, 0)  # temperature, top_p, seed
    logprobs: int | None = None  # top log-probs to report per emitted token; None: report none
    llm_seen: int = 0  # tokens of this row in the LLM cache
    waited: int = -1  # -1: not waiting for the LLM; else steps waited so far
    # The events of the row's provisional SLM tokens, the last len(pending) of seq, released once checked.
    pending: list[Emitted] = field(default_factory=list)
    check: int | None = None  # a check call's SLM proposal for this step (verified in the call)
    check_lp: TopLogprobs | None = None
    unfed: bool = False  # its last token (the LLM's, in an overlapped step) reaches the SLM at the next step

    @property
    def n_out(self) -> int:  # tokens emitted so far: the row's own step, which keys its random draws
        return len(self.seq) - self.prompt_len

    @property
    def verified(self) -> int:  # seq[:verified] is final; seq[verified:] are provisional SLM tokens
        return len(self.seq) - len(self.pending)
