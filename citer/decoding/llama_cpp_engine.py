""":class:`LlamaCppEngine`: the routed engine's interface (``generate_batch`` and its :class:`GenerationResult`,
step-level sessions for ``citer serve``, teacher-forced :meth:`~LlamaCppEngine.positions`) with both models as GGUF
files on llama.cpp, so ``citer route``, the sweep and ``citer serve`` run on the runner ``engine.runner: llama_cpp``
names and τ is chosen on the runner that serves. The decoding is
:class:`~citer.decoding.llama_cpp_routed.LlamaCppSession`; costs are metered as the torch engine's, at the files' own
bytes and llama.cpp's F16 KV cache. Not here (the torch engine's): compiled forwards, overlapped calls.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from citer.decoding.baselines import Router, router_read_bytes, wants_row_ids
from citer.decoding.call_rule import StepTimes
from citer.decoding.cost import CostMeter
from citer.decoding.decide import route
from citer.decoding.engine import GenerationResult, decode_all
from citer.decoding.llama_cpp_routed import MAX_SEQUENCES, LlamaCppSession
from citer.decoding.llama_cpp_runner import LlamaCppModel
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


class LlamaCppEngine:
    """Routed generation on llama.cpp between the GGUF files ``slm`` and ``llm`` (``llm=None``: the SLM alone, with
    an :class:`AlwaysSLM` router); ``rows``: the contexts' first size. The other arguments are the torch engine's
    (:class:`~citer.decoding.engine.RoutedEngine`); ``vocab_size`` defaults to the smaller vocabulary."""

    runner = "llama_cpp"

    def __init__(
        self,
        slm: str | os.PathLike[str],
        llm: str | os.PathLike[str] | None,
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
        self.slm = LlamaCppModel(Path(slm), rows, 64, hidden=llm is not None)
        self.llm = LlamaCppModel(Path(llm), rows, 64) if llm is not None else None
        models = [self.slm] if self.llm is None else [self.slm, self.llm]
        try:  # the ids both may emit, checked as the torch engine checks them
            self.vocab_size = vocab_within([(m.path.name, m.vocab_size) for m in models], vocab_size)
        except PairingError as exc:
            raise EngineInputError(str(exc)) from exc
        self.router_bytes = router_read_bytes(router, None) if self.llm is not None else 0
        self.cost_slm = self.slm.cost().plus(self.router_bytes)
        self.cost_llm = self.llm.cost() if self.llm is not None else None
        self._lease: weakref.ref[LlamaCppSession] | None = None
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

    def session(
        self, *, max_rows: int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
    ) -> LlamaCppSession:
        """A step-level session on the engine's contexts, or on contexts of its own (over the same weights) while
        another live session holds them; ``max_rows`` bounds the SLM's batch."""
        holder = self._lease() if self._lease is not None else None
        own = holder is not None and not holder.closed
        slm = self.slm.twin() if own else self.slm
        llm = None if self.llm is None else self.llm.twin() if own else self.llm
        sess = LlamaCppSession(
            slm, llm, self.router if llm is not None else None, self.tau,
            meter=CostMeter(self.cost_slm, self.cost_llm, 0, self.gpu), eos_ids=self.eos,
            vocab_size=self.vocab_size, rule=self.call_rule, times=self.times, max_rows=max_rows,
            temperature=temperature, top_p=top_p, seed=seed, verify=self.verify, llm_prefill=self.llm_prefill,
        )  # fmt: skip
        if not own:
            self._lease = weakref.ref(sess)
        return sess

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
