"""A step-level scheduler for routed decoding: rows join and leave a running batch at any step (continuous batching).

A :class:`DecodeSession` holds both models' ragged KV caches as slot pools (:class:`~citer.decoding.kv_cache.
RaggedKVCache`), the SLM's latest logits and hidden state per slot, and a cost meter. Each :meth:`DecodeSession.step`:

1. admits waiting requests (one SLM prefill call over the newcomers, up to ``max_rows`` active rows);
2. routes every row that is not already waiting for the LLM: the router reads its hidden state, the SLM proposes a
   token; rows scoring below tau wait for the LLM instead;
3. calls the LLM over the waiting rows -- each catches up on every token it has not seen -- when at least
   ``llm_min_rows`` rows wait, or one has waited ``llm_max_wait_steps`` steps, or nothing else can advance. A waiting
   row does not advance (its next token is the LLM's), so sharing one LLM weight read among several rows changes no
   row's tokens, only when they arrive;
4. emits one token for every row that advanced, retires rows at EOS or their token budget (their slots are reused),
   and feeds the new tokens to the SLM in one call; held rows ride along in it without writing.

A row's random draws (router noise, sampling) are keyed by its ``row_id`` and its own token index, never by the step
or by its neighbours, so a row's tokens do not depend on what else is in the batch.
Shapes: b = active rows (slots 0..b-1), V = vocab, H = SLM hidden.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from citer.decoding.cost import CostMeter, ModelCost, RowStats
from citer.decoding.kv_cache import RaggedKVCache, ragged_append
from citer.decoding.pairing import cut_logits
from citer.decoding.sampling import select_tokens


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
    llm_min_rows: int
    llm_max_wait_steps: int

    def check_prompts(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None: ...

    def score(self, hidden: torch.Tensor, row_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor: ...

    def static_for(self, which: str) -> Any: ...


class EngineInputError(ValueError):
    """Bad arguments to the engine; raised before any generation."""


def check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0.0 or not 0.0 < top_p <= 1.0:
        raise EngineInputError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")


@dataclass
class Emitted:
    """One token chosen at a step for the row ``key``; ``done``: the row has finished and left the batch.

    For a row added with ``logprobs=k``: ``logprob``, the token's log-probability under the distribution of the model
    that wrote it (temperature 1, over the shared vocabulary), and ``top_logprobs``, that distribution's ``k``
    likeliest ``(token, logprob)`` (``k`` = 0: none). Other rows leave both None."""

    key: int
    token: int
    from_llm: bool
    done: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class _Row:
    key: int  # the caller's handle; also the meter's row index
    row_id: int  # keys the random router and the sampler
    seq: list[int]
    prompt_len: int
    max_new: int
    sampling: tuple[float, float, int] = (0.0, 1.0, 0)  # temperature, top_p, seed
    logprobs: int | None = None  # top log-probs to report per emitted token; None: report none
    llm_seen: int = 0  # tokens of this row in the LLM cache
    waited: int = -1  # -1: not waiting for the LLM; else steps waited so far

    @property
    def n_out(self) -> int:  # tokens emitted so far: the row's own step, which keys its random draws
        return len(self.seq) - self.prompt_len


class DecodeSession:
    """Rows of one engine decoded together; see the module docstring. Not thread-safe: one caller steps it."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_rows: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        capacity: int = 0,
    ) -> None:
        self.e = engine
        self.max_rows = max_rows
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.meter = CostMeter(engine.cost_slm, engine.cost_llm, 0, engine.gpu)
        self.slm_cache = RaggedKVCache(engine.slm, 0, capacity)
        self.llm_cache = RaggedKVCache(engine.llm, 0, capacity) if engine.llm is not None else None
        self.slm_cache.static = engine.static_for("slm")
        if self.llm_cache is not None:
            self.llm_cache.static = engine.static_for("llm")
        self.rows: list[_Row] = []  # slot -> row: active rows in slot order
        self.queue: deque[_Row] = deque()  # admitted by a later step
        self.logits: torch.Tensor | None = None  # (b, V) the SLM's next-token logits per slot
        self.hidden: torch.Tensor | None = None  # (b, H) the router's input per slot
        # slot -> (logprob, top) of this step's token, for rows that asked for them
        self._lp: dict[int, tuple[float, list[tuple[int, float]]]] = {}

    # -- the caller's side ------------------------------------------------------------------------------------------
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
    ) -> int:
        """Queue a row (checked now, admitted at the next step); returns its key. Sampling settings default to the
        session's; rows of one batch may differ (each server request brings its own). ``logprobs=k`` (>= 0): each
        of the row's :class:`Emitted` carries its token's log-probability and the ``k`` likeliest alternatives."""
        self.e.check_prompts([prompt], max_new_tokens, None)
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0
        ):
            raise EngineInputError(f"logprobs must be an integer >= 0 or None, got {logprobs!r}")
        samp = (
            self.temperature if temperature is None else float(temperature),
            self.top_p if top_p is None else float(top_p),
            self.seed if seed is None else int(seed),
        )
        check_sampling(samp[0], samp[1])
        key = self.meter.add_rows(1)[0]
        seq = [int(t) for t in prompt]
        rid = key if row_id is None else int(row_id)
        self.queue.append(
            _Row(
                key=key,
                row_id=rid,
                seq=seq,
                prompt_len=len(seq),
                max_new=max_new_tokens,
                sampling=samp,
                logprobs=logprobs,
            )
        )
        return key

    @torch.inference_mode()
    def cancel(self, key: int) -> bool:
        """Drop a queued or active row (a client went away); True if it was there."""
        for r in self.queue:
            if r.key == key:
                self.queue.remove(r)
                return True
        for s, r in enumerate(self.rows):
            if r.key == key:
                self._retire([s])
                return True
        return False

    def reserve(self, columns: int) -> None:
        """Size both caches for rows of up to ``columns`` tokens now, so admissions never copy them to grow."""
        for c in (self.slm_cache, self.llm_cache):
            if c is not None:
                c.ensure_capacity(columns)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.queue)

    def stats(self, key: int) -> RowStats:
        return self.meter.row_stats([key])[0]

    # -- one step ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Emitted]:
        """Advance every row that can by one token; returns the tokens chosen at this step."""
        self._admit()
        if not self.rows:
            return []
        e, b = self.e, len(self.rows)
        ready = [s for s, r in enumerate(self.rows) if r.waited < 0]
        tok: dict[int, int] = {}  # slot -> token emitted this step
        self._lp = {}
        if ready:
            assert self.hidden is not None and self.logits is not None
            rid = torch.tensor(
                [self.rows[s].row_id for s in ready], dtype=torch.long
            )  # (k,) keys for the noise
            steps = torch.tensor([self.rows[s].n_out for s in ready], dtype=torch.long)  # (k,)
            idx = torch.tensor(ready, dtype=torch.long, device=self.hidden.device)
            hidden = self.hidden.index_select(0, idx) if len(ready) < b else self.hidden  # (k, H)
            logits = self.logits.index_select(0, idx) if len(ready) < b else self.logits  # (k, V)
            scores = e.score(hidden, rid, steps)  # (k,)
            proposal = self._choose(logits, [self.rows[s] for s in ready], rid, steps)
            to_llm = (scores < e.tau).tolist()  # one device sync for the whole batch, not one per row
            for i, s in enumerate(ready):
                if to_llm[i]:
                    self.rows[s].waited = 0
                else:
                    tok[s] = proposal[i]
            self._note_logprobs(logits, [s if s in tok else -1 for s in ready], proposal)
        waiting = [s for s in range(b) if self.rows[s].waited >= 0]
        if waiting and self._llm_due(waiting, advancing=len(tok)):
            for s, t in zip(waiting, self._llm_tokens(waiting), strict=True):
                tok[s] = t
        held = [s for s in waiting if s not in tok]
        for s in held:
            self.rows[s].waited += 1
        self.meter.step([self.rows[s].key for s in held])
        emitted, fed = self._emit(tok)
        self._feed_slm(fed)
        return emitted

    def _llm_due(self, waiting: list[int], advancing: int) -> bool:
        e = self.e
        if advancing == 0:  # nothing else moves: waiting longer gains nothing
            return True
        if len(waiting) >= e.llm_min_rows:
            return True
        return max(self.rows[s].waited for s in waiting) >= e.llm_max_wait_steps

    def _llm_tokens(self, slots: list[int]) -> list[int]:
        e = self.e
        if self.llm_cache is None:
            raise ValueError("router sent a token to the LLM but the engine has llm=None")
        rows = [self.rows[s] for s in slots]
        chunks = [r.seq[r.llm_seen :] for r in rows]
        logits, _ = ragged_append(e.llm, self.llm_cache, chunks, slots=slots)  # (k, V)
        keys = [r.key for r in rows]
        self.meter.forward("llm", keys, [len(c) for c in chunks], [len(r.seq) for r in rows])
        self.meter.llm_fed(
            keys,
            [max(r.prompt_len - r.llm_seen, 0) for r in rows],
            [len(r.seq) - max(r.llm_seen, r.prompt_len) for r in rows],
        )
        for r in rows:
            r.llm_seen = len(r.seq)
        rid = torch.tensor([r.row_id for r in rows], dtype=torch.long)
        steps = torch.tensor([r.n_out for r in rows], dtype=torch.long)
        toks = self._choose(logits, rows, rid, steps)
        self._note_logprobs(logits, slots, toks)
        return toks

    def _note_logprobs(self, logits: torch.Tensor, slots: list[int], toks: list[int]) -> None:
        """Keep, for the rows of ``slots`` that asked for them, the log-probs of ``toks`` under ``logits`` (k, V);
        slot -1 marks a row whose token comes from elsewhere. The same logits the token was chosen from."""
        want = [i for i, s in enumerate(slots) if s >= 0 and self.rows[s].logprobs is not None]
        if not want:
            return
        sel = torch.tensor(want, dtype=torch.long, device=logits.device)
        lp = torch.log_softmax(cut_logits(logits.index_select(0, sel), self.e.vocab_size).float(), dim=-1)
        chosen = lp.gather(1, torch.tensor([toks[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
        k = max(self.rows[slots[i]].logprobs or 0 for i in want)
        top_v, top_i = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (None, None)
        for j, i in enumerate(want):
            s = slots[i]
            kk = self.rows[s].logprobs or 0
            top = (
                list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist(), strict=True))
                if top_i is not None and top_v is not None and kk
                else []
            )
            self._lp[s] = (chosen[j], top)

    def _choose(
        self, logits: torch.Tensor, rows: list[_Row], rid: torch.Tensor, steps: torch.Tensor
    ) -> list[int]:
        """Tokens for ``rows`` from logits (k, V), one sampler call per distinct sampling setting."""
        logits = cut_logits(logits, self.e.vocab_size)
        groups: dict[tuple[float, float, int], list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r.sampling, []).append(i)
        if len(groups) == 1:
            ((t, p, seed),) = groups
            return select_tokens(logits, t, p, seed, rid, steps).tolist()
        out = [0] * len(rows)
        for (t, p, seed), idx in groups.items():
            sel = torch.tensor(idx, dtype=torch.long)
            toks = select_tokens(logits[sel.to(logits.device)], t, p, seed, rid[sel], steps[sel]).tolist()
            for i, tok in zip(idx, toks, strict=True):
                out[i] = tok
        return out

    def _emit(self, tok: dict[int, int]) -> tuple[list[Emitted], set[int]]:
        """Append each row's token; retire finished rows. Returns the tokens and the keys of the rows to feed."""
        out, done = [], []
        slots = sorted(tok)
        from_llm = [self.rows[s].waited >= 0 for s in slots]
        self.meter.emitted([self.rows[s].key for s in slots], from_llm)
        for s, llm in zip(slots, from_llm, strict=True):
            r = self.rows[s]
            r.seq.append(tok[s])
            r.waited = -1
            fin = tok[s] in self.e.eos or r.n_out >= r.max_new
            lp, top = self._lp.get(s, (None, None))
            out.append(Emitted(r.key, tok[s], llm, fin, lp, top))
            if fin:
                done.append(s)
        fed = {self.rows[s].key for s in slots if s not in done}
        self._retire(done)
        return out, fed

    def _feed_slm(self, fed: set[int]) -> None:
        if not self.rows or not fed:
            return
        # Held rows (waiting for the LLM) ride along with an empty chunk so the call stays over the slot prefix.
        chunks = [[r.seq[-1]] if r.key in fed else [] for r in self.rows]
        logits, hidden = ragged_append(self.e.slm, self.slm_cache, chunks)  # (b, V), (b, H)
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
        room = len(self.queue) if self.max_rows is None else self.max_rows - len(self.rows)
        new = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        if not new:
            return
        need = max(r.prompt_len + r.max_new for r in new)
        caches = [c for c in (self.slm_cache, self.llm_cache) if c is not None]
        for c in caches:
            c.ensure_capacity(need)
            slots = c.add_slots(len(new))
        logits, hidden = ragged_append(self.e.slm, self.slm_cache, [r.seq for r in new], slots=slots)
        self.meter.forward(
            "slm", [r.key for r in new], [r.prompt_len for r in new], [r.prompt_len for r in new]
        )
        self.rows += new
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])

    def _retire(self, slots: list[int]) -> None:
        if not slots:
            return
        # Both caches hold the same slots, so they move the same rows.
        moved = [c.remove_slots(slots) for c in (self.slm_cache, self.llm_cache) if c is not None][0]
        assert self.logits is not None and self.hidden is not None
        if moved:
            src = torch.tensor(list(moved), dtype=torch.long, device=self.logits.device)
            dst = torch.tensor(list(moved.values()), dtype=torch.long, device=self.logits.device)
            self.logits[dst] = self.logits[src]
            self.hidden[dst.to(self.hidden.device)] = self.hidden[src.to(self.hidden.device)]
            for a, b in moved.items():
                self.rows[b] = self.rows[a]
        n = len(self.rows) - len(slots)
        del self.rows[n:]
        self.logits, self.hidden = self.logits[:n], self.hidden[:n]
