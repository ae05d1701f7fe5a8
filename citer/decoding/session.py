"""A step-level scheduler for routed decoding: rows join and leave a running batch at any step (continuous batching).

A :class:`DecodeSession` holds both models' KV pools (:class:`~citer.decoding.kv_pool.KVPool`, a slot per row), the
SLM's latest logits and hidden state per slot, and a cost meter. Each :meth:`DecodeSession.step`:

1. admits waiting requests in one SLM prefill call, while fewer than ``max_rows`` rows are in the SLM's batch (a row
   waiting for the LLM has left it: :meth:`DecodeSession.room`); with ``llm_prefill="admit"`` one LLM call over
   their prompts too;
2. routes every row not already waiting for the LLM: the router reads its hidden state, the SLM proposes a token;
   rows scoring below tau wait for the LLM instead;
3. calls the LLM over the waiting rows -- each catches up on every token it has not seen -- when the engine's call
   rule says so (:mod:`citer.decoding.call_rule`) or nothing else can advance. A waiting row does not advance, so
   sharing one LLM call among several rows changes no row's tokens, only when they arrive (up to float rounding
   where a call's size picks the linears' kernel, :mod:`citer.kernels.cpu_linear`);
4. emits one token for every row that advanced, retires rows at EOS or their token budget (their slots are reused),
   and feeds the new tokens to the SLM in one call; held rows ride along in it without writing.

The LLM's catch-up has two halves, launch (the forward) and finish (tokens, checks). With ``engine.overlap`` a step
that calls the LLM while other rows advance launches the catch-up first (on CUDA on a stream of its own,
:class:`SideStream`), feeds those rows to the SLM next, and only then reads the LLM's tokens: a step costs the longer
of the two calls rather than their sum where the device overlaps them. The rows the LLM wrote for reach the SLM at the
next step: the same tokens, each LLM-written one a step later for its row.

A row's random draws (router noise, sampling) are keyed by its ``row_id`` and its own token index, never by the step
or its neighbours, so a row's tokens do not depend on what else is in the batch. With verification on
(:mod:`citer.decoding.verify`) an LLM call also checks the row's provisional SLM tokens and may cut the row and rewind
both caches, and a row may call the LLM only to check; :meth:`DecodeSession.step` returns final tokens only.
Shapes: b = active rows (slots 0..b-1), k = rows in an LLM call, Q = its longest chunk, V = vocab, H = SLM hidden.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from citer.decoding.choice import (
    TopLogprobs,
    choose_token_tensor,
    read_to_host,
    token_logprobs,
)
from citer.decoding.cost import CostMeter
from citer.decoding.rows import (
    Emitted,
    Engine,
    EngineInputError,
    Row,
    RowQueue,
    check_sampling,
    checked_max_rows,
)
from citer.decoding.verdict import candidates, verdicts

__all__ = ["DecodeSession", "Emitted", "Engine", "EngineInputError", "SideStream", "check_sampling"]


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
        (``forward="graphs"``) stay in program order: replaying both models' graphs on two streams parted from the
        sequential tokens on a GPU, where eager steps on two streams kept every token (docs/gpu.md)."""
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


class DecodeSession(RowQueue):
    """Rows of one engine decoded together; see the module docstring. Not thread-safe: one caller steps it."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_rows: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> None:
        check_sampling(temperature, top_p)
        self.e = engine
        self.max_rows = checked_max_rows(max_rows)
        self.sampling = (float(temperature), float(top_p), int(seed))
        self.meter = CostMeter(engine.cost_slm, engine.cost_llm, 0, engine.gpu)
        # The engine's pools (kept across sessions, so captured steps keep their addresses), or this session's own
        # while another session holds them.
        self.slm_pool, self.llm_pool = engine.pools_for(self)
        self.closed = False  # set when the caller is done: the engine may lend the pools to the next session
        # Where an overlapped catch-up runs.
        self.side = SideStream.for_engine(engine)
        self.rows: list[Row] = []  # slot -> row: active rows in slot order
        self.queue: deque[Row] = deque()  # admitted by a later step
        self.logits: torch.Tensor | None = None  # (b, V) the SLM's next-token logits per slot
        self.hidden: torch.Tensor | None = None  # (b, H) the router's input per slot
        # This step's slot -> (logprob, top) of its token, for rows that asked for them; the slots whose token the
        # LLM wrote; the slots an LLM call checked (their tokens are final); slot -> SLM tokens taken back.
        self._lp: dict[int, TopLogprobs] = {}
        self._llm_wrote: set[int] = set()
        self._checked: set[int] = set()
        self._replaced: dict[int, list[int]] = {}
        # Fixed-shape SLM steps: the next step's proposals and hard flags (b,), and the keys of the rows fed.
        self._decided: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None

    # -- the caller's side (add, cancel, room: RowQueue) ------------------------------------------------------------
    def _check_row(self, prompt: Sequence[int], draft: list[int], max_new_tokens: int) -> None:
        self.e.check_prompts([[*prompt, *draft]], max_new_tokens - len(draft), None)

    @torch.inference_mode()
    def _drop(self, row: Row) -> None:
        self._retire([self.rows.index(row)])

    def reserve(self, columns: int) -> None:
        """Size both caches for rows of up to ``columns`` tokens now, so admissions never copy them to grow."""
        for c in (self.slm_pool, self.llm_pool):
            if c is not None:
                c.ensure_capacity(columns)

    # -- one step ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Emitted]:
        """Advance every row that can by one token; returns the tokens chosen at this step."""
        self._admit()
        if not self.rows:
            return []
        t0 = time.perf_counter()
        e, b = self.e, len(self.rows)
        ready = [s for s, r in enumerate(self.rows) if r.waited < 0 and not r.unfed]
        tok: dict[int, int] = {}  # slot -> token emitted this step
        self._lp, self._llm_wrote, self._checked, self._replaced = {}, set(), set(), {}
        if ready:
            assert self.hidden is not None and self.logits is not None
            idx = torch.tensor(ready, dtype=torch.long, device=self.hidden.device)
            logits = self.logits.index_select(0, idx) if len(ready) < b else self.logits  # (k, V)
            rows = [self.rows[s] for s in ready]
            dec = self._decided
            if dec is not None and all(r.key in dec[2] for r in rows):
                # Decided inside the last SLM step's graph (fixed-shape steps): proposals and flags of every slot.
                chosen, hard = (x.index_select(0, idx) if len(ready) < b else x for x in dec[:2])
            else:
                # (k,) each: the rows' keys for the noise and their step indices
                rid, steps = torch.tensor([[r.row_id for r in rows], [r.n_out for r in rows]])
                hidden = self.hidden.index_select(0, idx) if len(ready) < b else self.hidden  # (k, H)
                hard = e.route(hidden, rid, steps)  # (k,)
                chosen = choose_token_tensor(
                    logits, [r.sampling for r in rows], rid, steps, e.vocab_size
                )  # (k,)
            # One device -> host read per step: the proposals and the router's flags together.
            proposal, to_llm = read_to_host(torch.stack((chosen, hard.to(chosen))))
            lps = token_logprobs(logits, proposal, [r.logprobs for r in rows], e.vocab_size)
            for i, (s, r) in enumerate(zip(ready, rows, strict=True)):
                if to_llm[i]:
                    r.waited = 0
                elif e.verify.wants_check(len(r.pending), proposal[i] in e.eos or r.n_out + 1 >= r.max_new):
                    r.waited, r.check, r.check_lp = 0, proposal[i], lps[i]
                else:
                    tok[s] = proposal[i]
                    if lps[i] is not None:
                        self._lp[s] = lps[i]
        routed = sum(1 for s in ready if self.rows[s].waited == 0)
        waiting = [s for s in range(b) if self.rows[s].waited >= 0]
        call = waiting if waiting and self._llm_due(waiting, advancing=len(tok)) else []
        held = [s for s in waiting if s not in call]
        for s in held:
            self.rows[s].waited += 1
        overlap = bool(call and tok and e.overlap)  # the SLM's step runs while the catch-up is in flight
        self.meter.step([self.rows[s].key for s in held], overlap)
        if overlap:
            launched = self._llm_launch(call)
            emitted, fed, done = self._emit(tok)
            self._feed_slm(fed | self._unfed())
            late, _, late_done = self._emit(self._llm_finish(launched))
            for s in call:  # fed at the next step, beside everyone else
                self.rows[s].unfed = s not in late_done
            self._retire(done + late_done)
            return emitted + late
        llm_s = 0.0
        if call:
            tokens = self._queued_tokens(call)
            t1 = time.perf_counter()
            tok.update(self._llm_call(call))
            llm_s = time.perf_counter() - t1
            e.times.llm_call(tokens, llm_s)
        emitted, fed, done = self._emit(tok)
        self._retire(done)
        self._feed_slm(fed | self._unfed())
        if tok:  # an SLM step ran: its seconds (the step's, less the LLM's call) and the rows it routed
            e.times.slm_step(time.perf_counter() - t0 - llm_s, routed)
        return emitted

    def _queued_tokens(self, slots: list[int]) -> int:
        """The tokens an LLM call over ``slots`` reads: each row's since the LLM last saw it."""
        return sum(len(self.rows[s].seq) - self.rows[s].llm_seen for s in slots)

    def _llm_due(self, waiting: list[int], advancing: int) -> bool:
        if advancing == 0:  # nothing else moves: waiting longer gains nothing
            return True
        waited = [self.rows[s].waited for s in waiting]
        return self.e.call_rule.due(waited, self.e.times)

    def _unfed(self) -> set[int]:
        """Keys of the rows whose last token (the LLM's, in an overlapped step) the SLM has not read yet."""
        return {r.key for r in self.rows if r.unfed}

    def _emit(self, tok: dict[int, int]) -> tuple[list[Emitted], set[int], list[int]]:
        """Append each row's token. Returns the final tokens (a provisional SLM token is held back until a call checks
        it or its row finishes), the keys of the rows to feed and the slots of the rows that finished (the caller
        retires them once this step's calls are queued)."""
        out, done = [], []
        slots = sorted(tok)
        from_llm = [s in self._llm_wrote for s in slots]
        self.meter.emitted([self.rows[s].key for s in slots], from_llm)
        provisional = self.e.verify.on
        for s, llm in zip(slots, from_llm, strict=True):
            r = self.rows[s]
            r.seq.append(tok[s])
            r.waited = -1
            fin = tok[s] in self.e.eos or r.n_out >= r.max_new
            lp, top = self._lp.get(s, (None, None))
            em = Emitted(r.key, tok[s], llm, fin, lp, top, self._replaced.get(s))
            if provisional and not fin and s not in self._checked:
                r.pending.append(em)
            else:
                out += r.pending
                out.append(em)
                r.pending.clear()
            if fin:
                done.append(s)
        fed = {self.rows[s].key for s in slots if s not in done}
        return out, fed, done

    def _feed_slm(self, fed: set[int]) -> None:
        if not self.rows or not fed:
            return
        for r in self.rows:
            if r.key in fed:
                r.unfed = False
        # Held rows (waiting for the LLM) ride along with an empty chunk so the call stays over the slot prefix.
        chunks = [[r.seq[-1]] if r.key in fed else [] for r in self.rows]
        # Fixed-shape and compiled steps decide the next step in their graph (proposals, flags (b,)) if every row
        # samples alike and the router can be traced.
        sampling, runner, decide = {r.sampling for r in self.rows}, self.e.slm_runner, None
        if len(sampling) == 1 and (runner.static is not None or runner.compiled is not None):
            decide = ([r.row_id for r in self.rows], [r.n_out for r in self.rows], self.e.decision(*sampling))
        out = runner.feed(self.slm_pool, chunks, decide=decide)
        self._decided = (out[2], out[3], fed) if len(out) == 4 else None
        logits, hidden = out[:2]  # (b, V), (b, H)
        fed = [s for s, c in enumerate(chunks) if c]
        idle = [s for s, c in enumerate(chunks) if not c]
        self.meter.forward(
            "slm", [self.rows[s].key for s in fed], [1] * len(fed), [len(self.rows[s].seq) for s in fed]
        )
        if idle:
            self.meter.held("slm", [self.rows[s].key for s in idle], [len(self.rows[s].seq) for s in idle])
            keep = torch.tensor([bool(c) for c in chunks], device=logits.device)[:, None]  # (b, 1)
            logits = torch.where(keep, logits, self.logits)  # held rows keep the state they wait on
            hidden = torch.where(keep.to(hidden.device), hidden, self.hidden)
        self.logits, self.hidden = logits, hidden

    # -- slots ------------------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        room = self.room()
        n = len(self.queue) if room is None else min(room, len(self.queue))
        caches = [c for c in (self.slm_pool, self.llm_pool) if c is not None]
        columns = [r.prompt_len + r.max_new for r in islice(self.queue, n)]
        n = min([n, *(c.room(columns) for c in caches)])
        new = [self.queue.popleft() for _ in range(n)]
        if not new:
            return
        need = max(columns[:n])
        for c in caches:
            c.ensure_capacity(need)
            slots = c.add_slots(len(new))
        logits, hidden = self.e.slm_runner.feed(self.slm_pool, [r.seq for r in new], slots=slots)
        self.meter.forward("slm", [r.key for r in new], [len(r.seq) for r in new], [len(r.seq) for r in new])
        if self.e.llm_prefill == "admit" and self.llm_pool is not None:
            self._llm_prefill(new, slots)
        self.rows += new
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])

    def _llm_prefill(self, new: list[Row], slots: list[int]) -> None:
        """The LLM reads the admitted rows' prompts but their last token in one call (``llm_prefill="admit"``); the
        last token stays for the row's first catch-up, whose logits there choose (or check) its first new token."""
        fed = [(r, s) for r, s in zip(new, slots, strict=True) if r.prompt_len > 1]
        if not fed:
            return
        assert self.llm_pool is not None and self.e.llm is not None
        chunks = [r.seq[: r.prompt_len - 1] for r, _ in fed]
        t = time.perf_counter()
        self.e.llm_runner.feed(self.llm_pool, chunks, slots=[s for _, s in fed])
        keys, n = [r.key for r, _ in fed], [len(c) for c in chunks]
        self.e.times.llm_call(sum(n), time.perf_counter() - t)
        self.meter.forward("llm", keys, n, n)
        self.meter.llm_fed(keys, n, [0] * len(n))
        for r, _ in fed:
            r.llm_seen = r.prompt_len - 1

    def _retire(self, slots: list[int]) -> None:
        if not slots:
            return
        # Both caches hold the same slots, so they move the same rows.
        moved = [c.remove_slots(slots) for c in (self.slm_pool, self.llm_pool) if c is not None][0]
        assert self.logits is not None and self.hidden is not None
        n = len(self.rows) - len(slots)
        dec = self._decided
        per_slot = [self.logits, self.hidden, *(dec[:2] if dec is not None else ())]  # (b, ...) each
        if moved:
            src, dst = list(moved), list(moved.values())
            for t in per_slot:
                t[torch.tensor(dst, device=t.device)] = t[torch.tensor(src, device=t.device)]
            for a, b in moved.items():
                self.rows[b] = self.rows[a]
        del self.rows[n:]
        self.logits, self.hidden, *kept = (t[:n] for t in per_slot)
        if dec is not None:  # the decisions move with their slots
            self._decided = (kept[0], kept[1], dec[2])

    # -- the LLM's catch-up call: launched, then finished -------------------------------------------------------------
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
                toks = choose_token_tensor(
                    call.logits, [r.sampling for r in rows], rid, steps, e.vocab_size
                ).tolist()
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
        caught-up position (:func:`~citer.decoding.verdict.verdicts`); cut a row at its first rejected token."""
        e = self.e
        cands = candidates(rows)
        dev = logits.device
        at_row = torch.tensor([i for i, _ in cands], device=dev)
        at_col = torch.tensor([t - 1 - rows[i].llm_seen for i, t in cands], device=dev)  # chunk index
        found = verdicts(rows, cands, logits[at_row, at_col], e.vocab_size, e.verify.rho)
        out: dict[int, int] = {}
        for s, r, v in zip(slots, rows, found, strict=True):
            r.llm_seen = len(r.seq)
            out[s] = v.token
            if v.from_llm:
                self._llm_wrote.add(s)
            if v.logprob is not None:
                self._lp[s] = v.logprob
            if v.cut is not None:
                self._rewind(s, r, v.cut)
            r.check, r.check_lp = None, None
        return out

    def _rewind(self, s: int, r: Row, t: int) -> None:
        """Take back the row's provisional tokens from seq index ``t`` on; both caches forget them."""
        assert t >= r.verified
        self._replaced[s] = r.seq[t:]
        self.meter.rolled_back([r.key], [len(r.seq) - t])
        del r.pending[t - r.verified :]  # before seq: ``verified`` is derived from both
        del r.seq[t:]
        assert self.llm_pool is not None
        for c in (self.slm_pool, self.llm_pool):
            c.rewind(s, t)
        r.llm_seen = t
