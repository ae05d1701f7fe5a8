""":class:`LlamaCppEngine`: the routed engine's interface (``generate_batch`` and its :class:`GenerationResult`,
step-level sessions for ``citer serve``, teacher-forced :meth:`~LlamaCppEngine.positions`) with both models as GGUF
files on llama.cpp, so ``citer route``, the sweep and ``citer serve`` run on the runner ``engine.runner: llama_cpp``
names and τ is chosen on the runner that serves. The decoding is the torch engine's
:class:`~citer.decoding.session.DecodeSession` (its scheduler, router, sampler and verification), its calls run by a
:class:`~citer.decoding.llama_cpp_runner.LlamaCppRunner` over each model's context
(:class:`~citer.decoding.llama_cpp_runner.LlamaCppPool`); costs are metered as the torch engine's, at the files' own
bytes and llama.cpp's F16 KV cache. Not here (the torch engine's): compiled forwards, overlapped calls.
:func:`routed_generate` and :func:`solo_generate` decode a list of prompts on loaded models, with the calls' counts and
seconds (what ``bench/llama_cpp_routed.py`` reports).
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from citer.decoding.baselines import AlwaysSLM, Router, router_read_bytes, wants_row_ids
from citer.decoding.call_rule import CallRule, FixedRule, StepTimes
from citer.decoding.decide import Sampling, route
from citer.decoding.engine import GenerationResult, decode_all
from citer.decoding.llama_cpp_runner import MAX_SEQUENCES, LlamaCppModel, LlamaCppPool, LlamaCppRunner
from citer.decoding.pairing import PairingError, vocab_within
from citer.decoding.rows import (
    EngineInputError,
    check_prompts,
    check_sampling,
    checked_llm_prefill,
    checked_routing,
    engine_call_rule,
    engine_verification,
    eos_ids,
)
from citer.decoding.session import DecodeSession


class LlamaCppEngine:
    """Routed generation on llama.cpp between the GGUF files ``slm`` and ``llm`` (``llm=None``: the SLM alone, with
    an :class:`AlwaysSLM` router), or between models already loaded (the SLM's context returning hidden states where
    it routes); ``rows``: the contexts' first size. The other arguments are the torch engine's
    (:class:`~citer.decoding.engine.RoutedEngine`); ``vocab_size`` defaults to the smaller vocabulary."""

    runner = "llama_cpp"
    overlap = False  # one process, one set of cores: nothing to overlap

    def __init__(
        self,
        slm: str | os.PathLike[str] | LlamaCppModel,
        llm: str | os.PathLike[str] | LlamaCppModel | None,
        router: Router,
        tau: float = 0.5,
        eos_token_id: int | Sequence[int] | None = None,
        vocab_size: int | None = None,
        gpu: str = "H100",
        rows: int = 8,
        llm_min_rows: int = 1,
        llm_max_wait_steps: int = 0,
        llm_schedule: str = "fixed",
        llm_prefill: str = "lazy",
        verify_rho: float = math.inf,
        verify_window: int = 0,
        verify_final: bool = False,
    ) -> None:
        self.tau = checked_routing(router, llm is not None, tau)
        self.router, self.gpu = router, gpu
        self.call_rule = engine_call_rule(llm_schedule, llm_min_rows, llm_max_wait_steps)
        self.llm_prefill = checked_llm_prefill(llm_prefill)
        self.verify = engine_verification(verify_rho, verify_window, verify_final, llm is not None)
        self.times = StepTimes()  # the engine's measured calls, which a measured rule reads
        self.eos = eos_ids(eos_token_id)
        self.slm = (
            slm
            if isinstance(slm, LlamaCppModel)
            else LlamaCppModel(Path(slm), rows, 64, hidden=llm is not None)
        )
        self.llm = (
            llm if isinstance(llm, LlamaCppModel) or llm is None else LlamaCppModel(Path(llm), rows, 64)
        )
        if self.llm is not None and not self.slm.hidden:
            raise ValueError(
                f"{self.slm.path.name}: the SLM's context must return hidden states (hidden=True)"
            )
        self.slm_runner = LlamaCppRunner()
        self.llm_runner = LlamaCppRunner() if self.llm is not None else None
        models = [self.slm] if self.llm is None else [self.slm, self.llm]
        try:  # the ids both may emit, checked as the torch engine checks them
            self.vocab_size = vocab_within([(m.path.name, m.vocab_size) for m in models], vocab_size)
        except PairingError as exc:
            raise EngineInputError(str(exc)) from exc
        self.router_bytes = router_read_bytes(router, None) if self.llm is not None else 0
        self.cost_slm = self.slm.cost().plus(self.router_bytes)
        self.cost_llm = self.llm.cost() if self.llm is not None else None
        self._lease: weakref.ref[DecodeSession] | None = None
        self._scoring: dict[str, LlamaCppModel] = {}  # a context per model for teacher-forced passes

    def close(self) -> None:
        for m in (*self._scoring.values(), self.slm, self.llm):
            if m is not None:
                m.close()

    def check_prompts(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None:
        """Raise :class:`EngineInputError` for prompts or a budget these models cannot take."""
        models = [self.slm] if self.llm is None else [self.slm, self.llm]
        check_prompts(prompts, max_new_tokens, row_ids, self.vocab_size,
                      [(n, m.max_positions) for n, m in zip(("slm", "llm"), models, strict=False)])  # fmt: skip

    def route(self, hidden: torch.Tensor, row_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The hard flags (b,) for hidden (b, H): the rows whose next token the LLM writes."""
        return route(self.router, wants_row_ids(self.router), self.tau, hidden, row_ids, steps)

    def positions(
        self, which: str, seqs: Sequence[Sequence[int]], rows: list[int], pos: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced: model ``which`` ("slm" | "llm") reads each of ``seqs`` whole; its logits (n, V) and hidden
        states (n, H; None for the LLM) at the pairs (``rows[i]``, ``pos[i]``), on a context of its own (a live
        session's rows untouched), :data:`MAX_SEQUENCES` texts a decode."""
        model = self.slm if which == "slm" else self.llm
        assert model is not None, which
        ctx = self._scoring.get(which)
        if ctx is None:
            ctx = self._scoring[which] = model.twin(hidden=which == "slm")  # the SLM's even without a router
        chunk = min(len(seqs), MAX_SEQUENCES)
        ctx.fit(chunk, 1 << math.ceil(math.log2(max(len(q) for q in seqs))))
        logits, hidden = [], []
        order = sorted(range(len(rows)), key=lambda i: rows[i])  # by text, so each chunk's pairs are together
        for lo in range(0, len(seqs), chunk):
            part = [i for i in order if lo <= rows[i] < lo + chunk]
            if not part:
                continue
            got = ctx.positions([list(q) for q in seqs[lo : lo + chunk]], [rows[i] - lo for i in part],
                                [pos[i] for i in part])  # fmt: skip
            logits.append((part, got[0]))
            hidden.append((part, got[1]))
        back = torch.tensor([i for part, _ in logits for i in part]).argsort()  # to the callers' order
        out_l = torch.cat([t for _, t in logits]).index_select(0, back)
        if any(h is None for _, h in hidden):
            return out_l, None
        return out_l, torch.cat([h for _, h in hidden]).index_select(0, back)

    def pools_for(self, session: DecodeSession) -> tuple[LlamaCppPool, LlamaCppPool | None]:
        """The engine's contexts as ``session``'s pools, emptied, while no other live session holds them; else pools
        over contexts of its own (twins over the same weights). The contexts grow to twice the session's
        ``max_rows`` (the live rows it may hold) at its first admission."""
        holder = self._lease() if self._lease is not None else None
        own = holder is not None and holder is not session and not holder.closed
        if not own:
            self._lease = weakref.ref(session)
        hint = 2 * session.max_rows if session.max_rows else 1
        pools = [
            None if m is None else LlamaCppPool(m.twin() if own else m, hint) for m in (self.slm, self.llm)
        ]
        for c in pools:
            if c is not None:
                c.reset()
        assert pools[0] is not None
        return pools[0], pools[1]

    def session(
        self, *, max_rows: int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
    ) -> DecodeSession:
        """A step-level session on the engine's contexts, or on contexts of its own (over the same weights) while
        another live session holds them; ``max_rows`` bounds the SLM's batch."""
        return DecodeSession(self, max_rows=max_rows, temperature=temperature, top_p=top_p, seed=seed)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, **kwargs) -> GenerationResult:
        """One row: ``generate_batch([prompt], ...)``."""
        return self.generate_batch([prompt], max_new_tokens, **kwargs)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        row_ids: Sequence[int] | None = None,
        max_rows: int | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Generate for every prompt through one :meth:`session`, ``max_rows`` (default all) bounding the SLM's
        batch, rows joining as others finish (at most 256 live: llama.cpp's sequence ids); ``row_ids`` (default
        0..n-1) key the random router and the sampler, as in the torch engine."""
        self.check_prompts(prompts, max_new_tokens, row_ids)
        check_sampling(temperature, top_p)
        t0 = time.perf_counter()
        sess = self.session(max_rows=max_rows, temperature=temperature, top_p=top_p, seed=seed)
        return decode_all(sess, prompts, max_new_tokens, row_ids, drafts, t0)


@dataclass
class RoutedRun:
    """Per prompt, the tokens written and which the LLM wrote; the calls each model ran and their seconds."""

    tokens: list[list[int]] = field(default_factory=list)
    from_llm: list[list[bool]] = field(default_factory=list)
    slm_calls: int = 0
    llm_calls: int = 0
    llm_tokens_read: int = 0  # tokens (prompts included) the LLM's calls read
    slm_s: float = 0.0
    llm_s: float = 0.0

    @property
    def llm_fraction(self) -> float:
        n = sum(len(x) for x in self.from_llm)
        return sum(sum(x) for x in self.from_llm) / n if n else 0.0


def routed_generate(
    slm: LlamaCppModel,
    llm: LlamaCppModel | None,
    prompts: Sequence[Sequence[int]],
    router: Router | None,
    tau: float,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = (0.0, 1.0, 0),
    row_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    max_rows: int | None = None,
    rule: CallRule = FixedRule(),
    times: StepTimes | None = None,
) -> RoutedRun:
    """Decode every prompt on the loaded models through a :class:`LlamaCppEngine`'s session, a row ending at an id of
    ``eos_ids`` (kept) or after ``max_new_tokens``. ``llm=None`` (and ``router=None``): the first model alone.
    ``row_ids`` (default 0..n-1) key a random router and the sampler; ``vocab_size`` (default the smaller model's)
    cuts logits before a choice; ``max_rows`` bounds the SLM's batch; ``rule``: when the LLM's queue is called
    (default at once), reading ``times`` (default fresh)."""
    engine = LlamaCppEngine(slm, llm, AlwaysSLM() if router is None else router, tau, eos_token_id=list(eos_ids),
                            vocab_size=vocab_size)  # fmt: skip
    engine.call_rule = rule
    engine.times = times if times is not None else StepTimes()
    temperature, top_p, seed = sampling
    got = engine.generate_batch(prompts, max_new_tokens, temperature, top_p, seed, row_ids, max_rows)
    run = RoutedRun(tokens=got.tokens, from_llm=got.from_llm)
    run.slm_calls, run.slm_s = engine.slm_runner.calls, engine.slm_runner.seconds
    if engine.llm_runner is not None:
        run.llm_calls, run.llm_s = engine.llm_runner.calls, engine.llm_runner.seconds
        run.llm_tokens_read = engine.llm_runner.tokens
    return run


def solo_generate(
    model: LlamaCppModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = (0.0, 1.0, 0),
    row_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """One model alone: :func:`routed_generate` with no LLM (the baseline a routed pair races, and the tokens a
    routed run must equal when nothing or everything is routed)."""
    return routed_generate(model, None, prompts, None, 1.0, max_new_tokens, eos_ids, sampling, row_ids).tokens
