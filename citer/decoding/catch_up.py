"""The LLM's catch-up call of a session step, in two halves -- launch (the forward) and finish (tokens, checks) -- so
an overlapping session can run the SLM's step between them.

With ``RoutedEngine(overlap=True)`` a step that calls the LLM and also has rows advancing with the SLM's tokens
launches the catch-up first, feeds those rows to the SLM next, and only then reads the LLM's tokens: the host never
waits for the LLM before the SLM's work is queued. On CUDA the catch-up runs on a stream of its own
(:class:`SideStream`), so the two models' kernels may run at once. The rows the LLM wrote for are fed to the SLM at
the next step, beside everyone else's tokens (one SLM call per step either way); until then they sit out the
decision. No row's tokens change -- each is still the same function of the row's own sequence and keyed draws --
only when they arrive: each LLM-written token costs its row one step, and a step costs the longer of the two calls
instead of their sum where the device can overlap them.

Shapes: k = rows in the call, Q = the longest chunk, V = vocab.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from citer.decoding.choice import TopLogprobs, choose_tokens, token_logprobs
from citer.decoding.cost import CostMeter
from citer.decoding.kv_pool import KVPool
from citer.decoding.pairing import cut_logits
from citer.decoding.rows import Engine, Row
from citer.decoding.verify import first_cuts


class SideStream:
    """Where an overlapped catch-up runs: a CUDA stream of its own, or (``stream`` None: CPU, or overlap off) the
    current stream, in program order. :meth:`run` first waits for the work queued on the current stream (admission
    and retirement copy KV rows the forward reads), unless ``wait`` is off; :meth:`join` makes the current stream wait
    for the catch-up before anything reads what it wrote."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream

    @classmethod
    def for_engine(cls, engine: Any) -> SideStream:
        """A stream of its own where the engine overlaps and its LLM is on CUDA with eager steps. Captured steps
        (``forward="graphs"``) stay in program order: on the first GPU run (H200, docs/gpu.md) an overlapped
        session replaying both models' graphs on two streams parted from the sequential tokens at step 38, and a
        batch-32 warm-up did not finish in 215 s; eager steps on two streams kept every token."""
        llm = engine.llm
        if not getattr(engine, "overlap", False) or llm is None:
            return cls()
        dev = next(llm.parameters()).device
        steps = engine.llm_runner.steps
        if dev.type != "cuda" or (steps is not None and steps.graphs):
            return cls()
        return cls(torch.cuda.Stream(dev))

    @contextmanager
    def run(self, wait: bool = True) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        if wait:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@dataclass
class Launched:
    """A catch-up whose forward is queued: the slots it serves and the LLM's logits there, (k, V) or, verifying,
    (k, Q, V) at every caught-up position."""

    slots: list[int]
    logits: torch.Tensor


class CatchUpCalls:
    """The catch-up half of :class:`~citer.decoding.session.DecodeSession` (its state lives there)."""

    e: Engine
    rows: list[Row]
    meter: CostMeter
    slm_pool: KVPool
    llm_pool: KVPool | None
    side: SideStream
    _lp: dict[int, TopLogprobs]
    _llm_wrote: set[int]
    _checked: set[int]
    _replaced: dict[int, list[int]]

    def _llm_call(self, slots: list[int]) -> dict[int, int]:
        """One LLM call over the waiting rows ``slots``; returns slot -> the token each emits this step."""
        return self._llm_finish(self._llm_launch(slots))

    def _llm_launch(self, slots: list[int]) -> Launched:
        """Queue the LLM's forward over the waiting rows ``slots``: each catches up on every token it has not seen."""
        e = self.e
        if self.llm_pool is None:
            raise ValueError("router sent a token to the LLM but the engine has llm=None")
        rows = [self.rows[s] for s in slots]
        chunks = [r.seq[r.llm_seen :] for r in rows]
        every = e.verify.on  # verification reads the LLM's distribution at every caught-up position
        with self.side.run():
            logits, _ = e.llm_runner.feed(self.llm_pool, chunks, slots=slots, every=every)
        keys = [r.key for r in rows]
        self.meter.forward("llm", keys, [len(c) for c in chunks], [len(r.seq) for r in rows])
        self.meter.llm_fed(
            keys,
            [max(r.prompt_len - r.llm_seen, 0) for r in rows],
            [len(r.seq) - max(r.llm_seen, r.prompt_len) for r in rows],
        )
        return Launched(slots, logits)

    def _llm_finish(self, call: Launched) -> dict[int, int]:
        """The launched call's tokens (one host read, waiting for the LLM only); slot -> the token each emits."""
        e, slots = self.e, call.slots
        rows = [self.rows[s] for s in slots]
        self._checked.update(slots)
        # Only the launched forward's logits are read here: not waiting for the current stream keeps the SLM step
        # queued there since the launch out of this read's way.
        with self.side.run(wait=False):
            if e.verify.on:
                out = self._verified(slots, rows, call.logits)
            else:
                for r in rows:
                    r.llm_seen = len(r.seq)
                rid = torch.tensor([r.row_id for r in rows], dtype=torch.long)
                steps = torch.tensor([r.n_out for r in rows], dtype=torch.long)
                toks = choose_tokens(call.logits, [r.sampling for r in rows], rid, steps, e.vocab_size)
                self._llm_wrote.update(slots)
                lps = token_logprobs(call.logits, toks, [r.logprobs for r in rows], e.vocab_size)
                for s, lp in zip(slots, lps, strict=True):
                    if lp is not None:
                        self._lp[s] = lp
                out = dict(zip(slots, toks, strict=True))
        self.side.join()
        return out

    def _verified(self, slots: list[int], rows: list[Row], logits: torch.Tensor) -> dict[int, int]:
        """Check each row's unverified tokens (and a check row's proposal) against the LLM's logits (k, Q, V) at every
        caught-up position; cut a row at its first rejected token. A forced row's last position is always the
        LLM's."""
        e = self.e
        # per candidate: its row, chunk position, token (-1: the LLM writes it) and step index
        owner: list[int] = []
        col: list[int] = []
        proposed: list[int] = []
        step_of: list[int] = []
        for i, r in enumerate(rows):
            for t in range(r.verified, len(r.seq) + 1):  # the token at seq index t, predicted at t - 1
                owner.append(i)
                col.append(t - 1 - r.llm_seen)
                step_of.append(t - r.prompt_len)
                proposed.append(r.seq[t] if t < len(r.seq) else -1 if r.check is None else r.check)
        dev = logits.device
        flat = logits[torch.tensor(owner, device=dev), torch.tensor(col, device=dev)]  # (N, V)
        rid = torch.tensor([rows[i].row_id for i in owner], dtype=torch.long)
        choice = choose_tokens(
            flat, [rows[i].sampling for i in owner], rid, torch.tensor(step_of), e.vocab_size
        )
        logp = torch.log_softmax(cut_logits(flat, e.vocab_size).float(), dim=-1)  # (N, V)
        cuts = first_cuts(logp, proposed, choice, owner, e.verify.rho, len(rows))
        out: dict[int, int] = {}
        for i, (s, r) in enumerate(zip(slots, rows, strict=True)):
            n = cuts[i]
            r.llm_seen = len(r.seq)
            if n < 0:  # every token passed, the check's proposal included: the SLM's token stands
                assert r.check is not None
                out[s] = r.check
                if r.check_lp is not None:
                    self._lp[s] = r.check_lp
            else:
                out[s] = choice[n]
                self._llm_wrote.add(s)
                lp = token_logprobs(flat[n : n + 1], [choice[n]], [r.logprobs], e.vocab_size)[0]
                if lp is not None:
                    self._lp[s] = lp
                t = step_of[n] + r.prompt_len
                if t < len(r.seq):
                    self._rewind(s, r, t)
            r.check, r.check_lp = None, None
        return out

    def _rewind(self, s: int, r: Row, t: int) -> None:
        """Take back the row's provisional tokens from seq index ``t`` on; both caches forget them."""
        assert t >= r.verified
        self._replaced[s] = r.seq[t:]
        self.meter.rolled_back([r.key], [len(r.seq) - t])
        del r.pending[t - r.verified :]  # before seq: ``verified`` is derived from both
        del r.seq[t:]
        self.slm_pool.lengths[s] = t
        assert self.llm_pool is not None
        self.llm_pool.lengths[s] = t
        r.llm_seen = t
