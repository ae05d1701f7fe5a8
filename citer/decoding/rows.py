"""What a decoding session is made of: the engine it needs, the rows it decodes, the tokens it emits, the caller's
side both runners' sessions share (:class:`RowQueue`), and the checks both engines apply to their arguments.

Shapes: k = rows, V = vocab.
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from citer.decoding.baselines import AlwaysSLM
from citer.decoding.call_rule import CallRule, StepTimes, call_rule
from citer.decoding.choice import TopLogprobs
from citer.decoding.cost import CostMeter, ModelCost, RowStats
from citer.decoding.decide import Sampling
from citer.decoding.verify import Verification, VerificationError


class Engine(Protocol):
    """What a session needs of an engine: :class:`~citer.decoding.engine.RoutedEngine` (torch models) or
    :class:`~citer.decoding.llama_cpp_engine.LlamaCppEngine` (GGUF models on llama.cpp)."""

    slm: Any  # the models: nn.Module, or llama_cpp_runner.LlamaCppModel
    llm: Any
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
    slm_runner: Any  # how each model's calls run: runner.ModelRunner, or llama_cpp_runner.LlamaCppRunner
    llm_runner: Any

    def check_prompts(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None: ...

    def route(self, hidden: torch.Tensor, row_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor: ...

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


def checked_draft(draft: Sequence[int], max_new_tokens: int) -> list[int]:
    """A row's draft as ints, refused where it leaves nothing of the row's budget."""
    d = [int(t) for t in draft]
    if d and len(d) >= max_new_tokens:
        raise EngineInputError(f"draft: {len(d)} tokens leave nothing of max_new_tokens={max_new_tokens}")
    return d


def new_row(
    meter: Any,
    prompt: Sequence[int],
    draft: list[int],
    max_new_tokens: int,
    row_id: int | None,
    defaults: Sampling,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    logprobs: int | None,
) -> Row:
    """The row a session's ``add`` queues (its prompt and draft already checked against the models), charged to
    ``meter`` (a :class:`~citer.decoding.cost.CostMeter`: its key) once every setting passed: the sampling settings
    default to the session's, ``row_id`` to the key; the draft's tokens lead as provisional SLM tokens."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise EngineInputError(f"logprobs must be an integer >= 0 or None, got {logprobs!r}")
    samp = (
        defaults[0] if temperature is None else float(temperature),
        defaults[1] if top_p is None else float(top_p),
        defaults[2] if seed is None else int(seed),
    )
    check_sampling(samp[0], samp[1])
    seq = [int(t) for t in prompt]
    rid = None if row_id is None else int(row_id)
    key = meter.add_rows(1)[0]
    if draft:
        meter.emitted([key] * len(draft), [False] * len(draft))
    return Row(
        key=key,
        row_id=key if rid is None else rid,
        seq=seq + draft,
        prompt_len=len(seq),
        max_new=max_new_tokens,
        sampling=samp,
        logprobs=logprobs,
        pending=[Emitted(key, t, False, False) for t in draft],
    )


LLM_PREFILL = ("lazy", "admit")  # when the LLM reads a row's prompt: at its first catch-up, or at admission


def checked_llm_prefill(value: str) -> str:
    """An engine's ``llm_prefill`` argument, refused as the engine's input error unless one of :data:`LLM_PREFILL`."""
    if value not in LLM_PREFILL:
        raise EngineInputError(f"llm_prefill must be 'lazy' or 'admit', got {value!r}")
    return value


def engine_verification(rho: float, window: int, final: bool, has_llm: bool) -> Verification:
    """An engine's ``verify_*`` arguments as a :class:`Verification`, refused as the engine's input error."""
    try:
        verify = Verification(rho, window, final)
    except VerificationError as exc:
        raise EngineInputError(str(exc)) from exc
    if verify.on and not has_llm:
        raise EngineInputError("verify_rho needs an LLM to verify with (llm=None)")
    return verify


def checked_routing(router: Any, has_llm: bool, tau: float) -> float:
    """An engine's ``tau`` as a float, refused as the engine's input error outside [0, 1], or where ``llm=None``
    comes with a router other than :class:`~citer.decoding.baselines.AlwaysSLM` (no LLM to route to)."""
    if not isinstance(tau, int | float) or not 0.0 <= float(tau) <= 1.0:
        raise EngineInputError(f"tau must lie in [0, 1], got {tau!r}")
    if not has_llm and not isinstance(router, AlwaysSLM):
        raise EngineInputError("llm=None needs an AlwaysSLM router (no LLM to route to)")
    return float(tau)


def eos_ids(eos_token_id: int | Sequence[int] | None) -> set[int]:
    """An engine's ``eos_token_id`` (one id, several, or None: stop at ``max_new_tokens`` only) as a set."""
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def engine_call_rule(schedule: str, min_rows: int, max_wait_steps: int) -> CallRule:
    """An engine's ``llm_schedule``/``llm_min_rows``/``llm_max_wait_steps`` as its
    :func:`~citer.decoding.call_rule.call_rule`, refused as the engine's input error."""
    try:
        return call_rule(schedule, min_rows, max_wait_steps)
    except ValueError as err:
        raise EngineInputError(str(err)) from None


def checked_max_rows(max_rows: int | None) -> int | None:
    """A session's ``max_rows`` (None: no bound), refused as the engine's input error unless an integer >= 1."""
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise EngineInputError(f"max_rows must be an integer >= 1 or None, got {max_rows!r}")
    return max_rows


class RowQueue:
    """The caller's side of a decoding session, either runner's: :meth:`add` queues a checked row, a later step
    admits it into ``rows`` (the live rows, in the session's own order), :meth:`cancel` drops one; ``max_rows`` bounds
    the SLM's batch. A session sets the attributes below and supplies ``_check_row`` (the row against its models) and
    ``_drop`` (free a live row's place)."""

    rows: list[Row]
    queue: deque[Row]
    meter: CostMeter
    max_rows: int | None
    sampling: Sampling  # the session's defaults: temperature, top_p, seed

    def _check_row(self, prompt: Sequence[int], draft: list[int], max_new_tokens: int) -> None:
        raise NotImplementedError

    def _drop(self, row: Row) -> None:
        raise NotImplementedError

    def add(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        row_id: int | None = None,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        draft: Sequence[int] = (),
    ) -> int:
        """Queue a row (checked now, admitted at a later step); returns its key. Sampling settings default to the
        session's; rows of one batch may differ (each server request brings its own). ``logprobs=k`` (>= 0): each
        of the row's :class:`Emitted` carries its token's log-probability and the ``k`` likeliest alternatives.
        ``draft``: the row's first new tokens, given as if the SLM had written them (counted in ``max_new_tokens``,
        returned as its first tokens, without log-probs); with verification on they are provisional like any SLM
        token, so a check may take them back -- what label rollouts ask: would the catch-up repair this token?"""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        d = checked_draft(draft, max_new_tokens)
        self._check_row(prompt, d, max_new_tokens)
        row = new_row(
            self.meter, prompt, d, max_new_tokens, row_id, self.sampling, temperature, top_p, seed, logprobs
        )
        self.queue.append(row)
        return row.key

    def cancel(self, key: int) -> bool:
        """Drop a queued or live row (a client went away); True if it was there."""
        for r in self.queue:
            if r.key == key:
                self.queue.remove(r)
                return True
        for r in self.rows:
            if r.key == key:
                self._drop(r)
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.queue)

    @property
    def stepping(self) -> int:
        """Rows in the SLM's batch: the live rows not waiting for the LLM."""
        return sum(1 for r in self.rows if r.waited < 0)

    def room(self) -> int | None:
        """How many more rows may be admitted now (None: any number). ``max_rows`` bounds the SLM's batch, not the
        live rows: a row waiting for the LLM leaves the batch and an admitted row takes its place, so the SLM keeps
        stepping ``max_rows`` rows while others wait (rows the LLM served rejoin it, and admissions pause until it is
        below ``max_rows`` again); the live rows, what the caches hold, stay at most twice ``max_rows``."""
        if self.max_rows is None:
            return None
        return max(0, min(self.max_rows - self.stepping, 2 * self.max_rows - len(self.rows)))

    def stats(self, key: int) -> RowStats:
        return self.meter.row_stats([key])[0]
