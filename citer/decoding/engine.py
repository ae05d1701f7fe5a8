"""Routed decoding between a small (SLM) and a large (LLM) model, one token at a time (CITER inference).

Each step, for every active row: the SLM's last-layer hidden state (after the final norm, at the position that
predicts the next token) goes to a router; rows scoring below tau are sent to the LLM, which first catches up on every
token of the row it has not yet seen -- all selected rows in ONE forward call -- and its token replaces the SLM's.
The emitted token is then fed to the SLM. Rows stop at EOS or ``max_new_tokens`` and leave the batch. The steps are
run by :class:`~citer.decoding.session.DecodeSession`, which also lets rows join a running batch; ``generate_batch``
is a loop over it.

Both models keep a :class:`~citer.decoding.kv_pool.KVPool`, so rows of different lengths share every call; each
model's calls run through its :class:`~citer.decoding.runner.ModelRunner`, which picks the forward from the engine's
one ``forward``. Logits are cut to the tokenizer's vocabulary before a token is chosen
(:mod:`citer.decoding.pairing`), so the models' embeddings may be padded to different sizes.
Shapes: b = rows in a call, V = vocab, H = hidden.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from citer.decoding.baselines import Router, router_read_bytes, wants_row_ids
from citer.decoding.call_rule import CallRule, StepTimes
from citer.decoding.cost import BatchStats, ModelCost, RowStats
from citer.decoding.decide import Decision, route
from citer.decoding.kv_pool import KVPool
from citer.decoding.padding import right_padded
from citer.decoding.pairing import (
    PairingError,
    check_full_attention,
    input_device,
    model_label,
    shared_vocab_size,
)
from citer.decoding.rows import (
    check_prompts,
    checked_llm_prefill,
    checked_routing,
    engine_call_rule,
    engine_verification,
    eos_ids,
)
from citer.decoding.runner import FORWARDS, ModelRunner
from citer.decoding.session import DecodeSession, EngineInputError


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when emitted, nothing after it
    from_llm: list[list[bool]]  # per new token: True when the LLM wrote it
    rows: list[RowStats]
    batch: BatchStats
    # per row, (index in ``tokens``, the provisional SLM tokens the LLM's token at that index took back)
    replaced: list[list[tuple[int, list[int]]]] = field(default_factory=list)


def _max_positions(model: nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).max_position_embeddings)


class RoutedEngine:
    """Token-level routed generation. ``llm=None`` is allowed with an :class:`~citer.decoding.baselines.AlwaysSLM` router.

    ``eos_token_id``: one id or several (None: stop at ``max_new_tokens`` only). ``pad_token_id`` is accepted for
    symmetry with HF and unused (pad slots repeat a real token and are masked). ``gpu`` names the bandwidth of the
    projected time (:data:`citer.decoding.cost.GPU_BANDWIDTH`). ``vocab_size``: the token ids the models share,
    ``len(tokenizer)`` (default: the smaller embedding).
    ``llm_min_rows`` (>= 1), ``llm_max_wait_steps`` (>= 0): at batch > 1 some row wants the LLM almost every step, so
    a routed row waits (without advancing) until that many rows want the LLM or it has waited that many steps, and
    one weight read serves several rows: the same tokens, later. 1 and 0 call at once; ``llm_schedule="measured"``
    derives the rule from the engine's measured step times (:mod:`citer.decoding.call_rule`).
    ``llm_prefill``: ``"lazy"`` the LLM reads a row's prompt in its first catch-up; ``"admit"`` every admitted prompt
    but its last token in one LLM call beside the SLM's prefill (one large call instead of prompts mixed into small
    catch-ups; wasted on a row the router never routes).
    ``forward``: how both models' calls run (:data:`~citer.decoding.runner.FORWARDS`); the choice is this engine's,
    another engine over the same models runs them as it was asked to.
    ``verify_rho``/``verify_window``/``verify_final``: verified routing (:mod:`citer.decoding.verify`); the defaults
    (inf, 0, False) are plain CITER. ``overlap``: a step queues the SLM's call while its LLM catch-up is in flight and
    feeds the LLM's tokens to the SLM a step later (:mod:`citer.decoding.session`): the same tokens, one more step per
    LLM token for its row.
    """

    runner = "torch"  # which kernels decode (engine.runner); the llama.cpp engine says "llama_cpp"

    def __init__(
        self,
        slm: nn.Module,
        llm: nn.Module | None,
        router: Router,
        tau: float = 0.5,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        gpu: str = "H100",
        vocab_size: int | None = None,
        llm_min_rows: int = 1,
        llm_max_wait_steps: int = 0,
        llm_schedule: str = "fixed",
        llm_prefill: str = "lazy",
        forward: str = "eager",
        verify_rho: float = math.inf,
        verify_window: int = 0,
        verify_final: bool = False,
        overlap: bool = False,
    ) -> None:
        self.tau = checked_routing(router, llm is not None, tau)
        for m in (slm, llm):
            if m is None:
                continue
            impl = m.config._attn_implementation
            if impl not in ("sdpa", "eager"):
                raise EngineInputError(
                    f"{model_label(m)}: attention implementation {impl!r} unsupported; use sdpa or eager"
                )
        try:
            for m in (slm, llm):
                if m is not None:
                    check_full_attention(m.config, model_label(m))
            # Embedding sizes may differ (padded rows); the token ids both may emit are the tokenizer's.
            self.vocab_size = shared_vocab_size(slm, llm, vocab_size)
        except PairingError as exc:
            raise EngineInputError(str(exc)) from exc
        self.slm, self.llm, self.router = slm, llm, router
        self.eos = eos_ids(eos_token_id)
        self.gpu = gpu
        self._router_ctx = wants_row_ids(router)
        # The router runs at every SLM step, so its reads join the SLM's (docs/cost_model.md).
        self.router_bytes = router_read_bytes(router, slm)
        self.cost_slm = ModelCost.from_model(slm).plus(self.router_bytes)
        self.cost_llm = ModelCost.from_model(llm) if llm is not None else None
        self.call_rule: CallRule = engine_call_rule(llm_schedule, llm_min_rows, llm_max_wait_steps)
        self.llm_min_rows, self.llm_max_wait_steps, self.llm_schedule = (
            llm_min_rows,
            llm_max_wait_steps,
            llm_schedule,
        )
        self.times = StepTimes()  # the engine's measured calls, which a measured rule reads
        self.llm_prefill = checked_llm_prefill(llm_prefill)
        if forward not in FORWARDS:
            raise EngineInputError(f"forward must be one of {list(FORWARDS)}, got {forward!r}")
        self.forward = forward
        self.slm_runner = ModelRunner(slm, forward)
        self.llm_runner = ModelRunner(llm, forward) if llm is not None else None
        if not isinstance(overlap, bool):
            raise EngineInputError(f"overlap must be true or false, got {overlap!r}")
        self.overlap = overlap
        self._pools: tuple[KVPool, KVPool | None] | None = None
        self._lease: weakref.ref[object] | None = None  # the session the pools are lent to
        self._decisions: dict[tuple[float, float, int], Decision] = {}
        self.verify = engine_verification(verify_rho, verify_window, verify_final, llm is not None)

    def pools_for(self, session: object) -> tuple[KVPool, KVPool | None]:
        """The engine's two KV pools, lent to ``session`` while no other live session holds them (emptied, their
        buffers and addresses kept, so captured steps replay across ``generate_batch`` calls); a second session at
        the same time gets pools of its own."""
        holder = self._lease() if self._lease is not None else None
        if holder is not None and holder is not session and not getattr(holder, "closed", False):
            return self._new_pools()
        if self._pools is None:
            self._pools = self._new_pools()
        for c in self._pools:
            if c is not None:
                c.reset()
        self._lease = weakref.ref(session)
        return self._pools

    def _new_pools(self) -> tuple[KVPool, KVPool | None]:
        slm = self.slm_runner.new_pool()
        return slm, self.llm_runner.new_pool() if self.llm_runner is not None else None

    def reserve(self, rows: int, columns: int) -> None:
        """Size the engine's pools for ``rows`` rows of up to ``columns`` tokens now, before anything is timed or
        served: a pool that grows later moves (captured steps re-capture) and, if its columns grow, recompiles."""
        if self._pools is None:
            self._pools = self._new_pools()
        for c, m in zip(self._pools, (self.slm, self.llm), strict=True):
            if c is not None and m is not None:
                c.reserve(rows, columns, next(m.parameters()))

    def decision(self, sampling: tuple[float, float, int]) -> Decision:
        """What the SLM's fixed-shape steps decide with, for rows sampling with ``sampling``: one object per setting,
        so a traced step keeps one graph per bucket (a new τ or router set on the engine makes a new one)."""
        got = self._decisions.get(sampling)
        if got is None or got.tau != self.tau or got.router is not self.router:
            got = self._decisions[sampling] = Decision(
                self.router, wants_row_ids(self.router), float(self.tau), self.vocab_size, sampling
            )
        return got

    @property
    def forward_paths(self) -> dict[str, str]:
        """Which forward each model runs: ``"lean"``, ``"lean+compiled"`` or ``"hf: <why not lean>"``."""
        out = {"slm": self.slm_runner.path}
        if self.llm_runner is not None:
            out["llm"] = self.llm_runner.path
        return out

    def check_prompts(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None:
        """Raise :class:`EngineInputError` for prompts or a budget these models cannot take."""
        limits = [("slm", _max_positions(self.slm))]
        if self.llm is not None:
            limits.append(("llm", _max_positions(self.llm)))
        check_prompts(prompts, max_new_tokens, row_ids, self.vocab_size, limits)

    def route(self, hidden: torch.Tensor, row_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The hard flags (b,) bool for hidden (b, H): the rows whose next token the LLM writes
        (:func:`~citer.decoding.decide.route`); ``row_ids``/``steps`` (b,) on the CPU key a random router."""
        return route(self.router, self._router_ctx, self.tau, hidden, row_ids, steps)

    def positions(
        self, which: str, seqs: Sequence[Sequence[int]], rows: list[int], pos: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: one causal pass of model ``which`` ("slm" | "llm") over ``seqs``; its logits (n, V) and
        hidden states (n, H) at the pairs (``rows[i]``, ``pos[i]``). Right padding needs no mask: a causal model's
        position never sees the pads after it. The engine's forward, but eager where its runners compile or capture: a
        pass over whole texts is one call of a shape no step repeats."""
        model = self.slm if which == "slm" else self.llm
        assert model is not None, which
        ids, _ = right_padded(seqs, 0)
        dev = input_device(model)
        pick = (torch.tensor(rows, device=dev), torch.tensor(pos, device=dev))
        runner = ModelRunner(model, "hf" if self.forward == "hf" else "eager")
        return runner.forward(ids.to(dev), last_index=pick)

    def session(
        self, *, max_rows: int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
    ) -> DecodeSession:
        """A step-level scheduler over this engine: add rows at any time, step, collect tokens as they come."""
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
        """Generate for every prompt: a :class:`DecodeSession` stepped until every row is done. ``row_ids`` (default
        0..n-1) key the random router and the sampler, so a caller splitting a long list into batches passes each
        row's global index to keep results batch-invariant. ``max_rows``: at most this many rows in the SLM's batch;
        the others join as rows finish or wait for the LLM (continuous batching, :meth:`DecodeSession.room`).
        ``drafts``: per row, first new tokens given as the SLM's (:meth:`DecodeSession.add`'s ``draft``); they lead
        the row's ``tokens`` unless a check took them back."""
        self.check_prompts(prompts, max_new_tokens, row_ids)
        t0 = time.perf_counter()
        sess = self.session(max_rows=max_rows, temperature=temperature, top_p=top_p, seed=seed)
        sess.reserve(max(len(p) for p in prompts) + max_new_tokens)
        return decode_all(sess, prompts, max_new_tokens, row_ids, drafts, t0)


# The block's settings that choose the runner itself, read by the caller (``route_engine``) before this engine exists.
RUNNER_SETTINGS = ("runner", "llama_cpp_type")
# The ``engine:`` block's settings the torch engine takes (``citer.config.serving.EngineParams`` checks them for the
# CLI; the engine checks each again, so a block read without pydantic -- the GPU bench -- is checked alike).
ENGINE_SETTINGS = ("llm_min_rows", "llm_max_wait_steps", "llm_schedule", "llm_prefill", "forward", "overlap")


def engine_from_block(
    slm: nn.Module, llm: nn.Module | None, router: Router, tau: float, block: Mapping[str, Any], **kwargs: Any
) -> RoutedEngine:
    """The torch engine an ``engine:`` block (a mapping, e.g. ``EngineParams.model_dump()``) describes: the one call
    by which ``citer route``, ``citer serve`` and the speed benches build it, so a bench times what they run. Settings
    the block leaves out take the engine's defaults (the params' own); ``kwargs`` are the rest of
    :class:`RoutedEngine`'s arguments (eos, vocabulary, verification)."""
    runner = block.get("runner", "torch")
    if runner != "torch":
        raise EngineInputError(f"engine.runner {runner!r}: the torch engine runs runner 'torch' only")
    known = [*ENGINE_SETTINGS, *RUNNER_SETTINGS]
    unknown = sorted(set(block) - set(known))
    if unknown:  # a typo, or a setting from older params (compile_forward), would otherwise be dropped unseen
        raise EngineInputError(f"engine: unknown settings {unknown}; known: {known}")
    return RoutedEngine(
        slm, llm, router, tau, **{k: block[k] for k in ENGINE_SETTINGS if k in block}, **kwargs
    )


def decode_all(
    sess: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    row_ids: Sequence[int] | None,
    drafts: Sequence[Sequence[int]] | None,
    t0: float,
) -> GenerationResult:
    """Add every prompt to a session (either runner's: ``add``, ``step``, ``busy``, ``meter``), step it until every
    row is done, and gather each row's tokens, which model wrote them and what verification took back; ``t0``: when
    the call began (the batch's wall seconds)."""
    try:
        ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
        if drafts is not None and len(drafts) != len(prompts):
            raise EngineInputError(f"drafts: need {len(prompts)} lists, got {len(drafts)}")
        keys = [
            sess.add(p, max_new_tokens, row_id=r, draft=drafts[i] if drafts is not None else ())
            for i, (p, r) in enumerate(zip(prompts, ids, strict=True))
        ]
        out_tok: dict[int, list[int]] = {k: [] for k in keys}
        out_llm: dict[int, list[bool]] = {k: [] for k in keys}
        out_rep: dict[int, list[tuple[int, list[int]]]] = {k: [] for k in keys}
        while sess.busy:
            for em in sess.step():
                if em.replaced:
                    out_rep[em.key].append((len(out_tok[em.key]), em.replaced))
                out_tok[em.key].append(em.token)
                out_llm[em.key].append(em.from_llm)
    finally:
        # The engine's pools (or contexts) are free for the next call, after a failure too: the next session
        # empties them before use.
        sess.closed = True
    rows, batch = sess.meter.finish(time.perf_counter() - t0)
    return GenerationResult(
        tokens=[out_tok[k] for k in keys],
        from_llm=[out_llm[k] for k in keys],
        rows=rows,
        batch=batch,
        replaced=[out_rep[k] for k in keys],
    )
