"""Routed decoding with both models on llama.cpp (:class:`~citer.decoding.llama_cpp_runner.LlamaCppModel`), a step at a
time: :class:`LlamaCppSession`, the llama.cpp runner's counterpart of :class:`~citer.decoding.session.DecodeSession`
(the same caller's side, so ``citer serve``'s scheduler steps either), whose steps, verification and random draws
these mirror, so a router and τ chosen on one runner decide the same way on the other.

Each :meth:`LlamaCppSession.step` admits queued rows while the SLM's batch has room, each taking a free sequence id in
both contexts; the SLM reads every stepping row's unread tokens in one batched decode and proposes, the router reading
the hidden states llama.cpp returns; the LLM catches the waiting rows up in one batched decode when the call rule
(:mod:`citer.decoding.call_rule`) says so or no other row advances; every row that advanced emits its token, and rows
at EOS or their budget free their sequence ids. :func:`routed_generate` decodes a list of prompts through a session;
:func:`solo_generate` is one model alone.
Shapes: b = rows the SLM steps, R = rows the LLM catches up, V = vocabulary, H = the SLM's hidden size.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from citer.decoding.baselines import wants_row_ids
from citer.decoding.call_rule import CallRule, FixedRule, StepTimes
from citer.decoding.choice import TopLogprobs, choose_token_tensor, token_logprobs
from citer.decoding.cost import CostMeter
from citer.decoding.decide import Sampling, route
from citer.decoding.llama_cpp_runner import LlamaCppModel
from citer.decoding.rows import Emitted, EngineInputError, Row, RowQueue, check_sampling, checked_max_rows
from citer.decoding.verify import Verification, candidates, verdicts

MAX_SEQUENCES = 256  # llama.cpp's limit on a context's sequence ids (LLAMA_MAX_SEQ); more rows take turns


@dataclass
class RoutedRun:
    """Per prompt, the tokens written and which the LLM wrote; the calls each model ran and their seconds."""

    tokens: list[list[int]] = field(default_factory=list)
    from_llm: list[list[bool]] = field(default_factory=list)
    slm_calls: int = 0
    llm_calls: int = 0
    llm_tokens_read: int = 0  # tokens (prompts included) the LLM's catch-ups read
    slm_s: float = 0.0
    llm_s: float = 0.0

    @property
    def llm_fraction(self) -> float:
        n = sum(len(x) for x in self.from_llm)
        return sum(sum(x) for x in self.from_llm) / n if n else 0.0


class LlamaCppSession(RowQueue):
    """Rows decoded together on llama.cpp; see the module docstring. ``llm=None`` (and ``router=None``): the SLM
    alone. ``max_rows`` bounds the SLM's batch (None: every row admitted at once, up to the contexts' sequence
    ids); the contexts grow, emptied, when no row is live. Not thread-safe: one caller steps it."""

    def __init__(
        self,
        slm: LlamaCppModel,
        llm: LlamaCppModel | None,
        router: Callable[..., torch.Tensor] | None,
        tau: float,
        *,
        meter: CostMeter,
        eos_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        rule: CallRule = FixedRule(),
        times: StepTimes | None = None,
        max_rows: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        verify: Verification = Verification(),
        llm_prefill: str = "lazy",
    ) -> None:
        if llm is not None and not slm.hidden:
            raise ValueError(f"{slm.path.name}: the SLM's context must return hidden states (hidden=True)")
        if (llm is None) != (router is None):
            raise ValueError("a router needs an LLM to route to, and an LLM a router")
        checked_max_rows(max_rows)
        check_sampling(temperature, top_p)
        self.slm, self.llm, self.router, self.tau = slm, llm, router, float(tau)
        self.models = [slm] if llm is None else [slm, llm]
        self.vocab_size = vocab_size or min(m.vocab_size for m in self.models)
        self.max_positions = min(m.max_positions for m in self.models)
        self.eos = {int(e) for e in eos_ids}
        self.rule, self.times = rule, times if times is not None else StepTimes()
        self.max_rows, self.sampling = max_rows, (float(temperature), float(top_p), int(seed))
        self.meter, self.verify = meter, verify
        # "admit": the LLM reads an admitted row's prompt (but its last token) at once, in one decode with the other
        # newcomers'; "lazy": at the row's first catch-up, which otherwise reads it.
        self.llm_prefill = llm_prefill
        # This step's rows (by key) an LLM call checked (their tokens are final) and SLM tokens it took back.
        self._checked: set[int] = set()
        self._replaced: dict[int, list[int]] = {}
        self._takes_rows = router is not None and wants_row_ids(router)
        self.rows: list[Row] = []  # live rows, in admission order
        self.queue: deque[Row] = deque()  # added, admitted by a later step
        self.seq_of: dict[int, int] = {}  # row key -> its sequence id in both contexts
        self._free: list[int] = []  # sequence ids no live row holds
        self.closed = (
            False  # set by the caller when done: the engine may lend its contexts to the next session
        )
        self.slm_calls = self.llm_calls = self.llm_tokens_read = 0
        self.slm_s = self.llm_s = 0.0
        for m in self.models:
            m.reset()

    # -- the caller's side (add, cancel, room: RowQueue) ------------------------------------------------------------
    def _check_row(self, prompt: Sequence[int], draft: list[int], max_new_tokens: int) -> None:
        seq = [int(t) for t in prompt]
        if not seq:
            raise EngineInputError("prompt: empty, nothing to continue")
        if bad := [t for t in seq + draft if not 0 <= t < self.vocab_size][:5]:
            raise EngineInputError(f"prompt: token ids outside [0, {self.vocab_size}): {bad}")
        if len(seq) + max_new_tokens > self.max_positions:
            raise EngineInputError(
                f"prompt: {len(seq)} tokens + max_new_tokens {max_new_tokens} exceed the models' "
                f"{self.max_positions} positions"
            )

    def _drop(self, row: Row) -> None:
        self._retire([row])

    # -- one step ---------------------------------------------------------------------------------------------------
    def step(self) -> list[Emitted]:
        """Advance every row that can by one token; returns the tokens chosen at this step."""
        self._admit()
        if not self.rows:
            return []
        self._checked, self._replaced = set(), {}
        tok: dict[int, tuple[int, bool, TopLogprobs | None]] = {}  # row key -> token, from the LLM, log-probs
        stepping = [r for r in self.rows if r.waited < 0]
        slm_s, routed = 0.0, 0
        if stepping:
            slm_s = self._slm_step(stepping, tok)
            routed = len(stepping) - len(tok)
        waiting = [r for r in self.rows if r.waited >= 0]
        due = bool(waiting) and (not tok or self.rule.due([r.waited for r in waiting], self.times))
        if due:
            self._llm_call(waiting, tok)
        else:
            for r in waiting:
                r.waited += 1
        self.meter.step([] if due else [r.key for r in waiting])
        if stepping:
            self.times.slm_step(slm_s, routed)
        return self._emit(tok)

    def _slm_step(self, stepping: list[Row], tok: dict[int, tuple[int, bool, TopLogprobs | None]]) -> float:
        """The SLM reads the stepping rows' unread tokens and proposes; rows the router sends start waiting, the
        others' proposals go in ``tok``. Returns the call's seconds."""
        fed = {self.seq_of[r.key]: r.seq[self.slm.lengths[self.seq_of[r.key]] :] for r in stepping}
        t0 = time.perf_counter()
        logits, hidden = self.slm.feed(fed)  # (b, V), (b, H)
        seconds = time.perf_counter() - t0
        self.slm_s += seconds
        self.slm_calls += 1
        keys = [r.key for r in stepping]
        # each row's new tokens and the columns it attends after the call, them included (the meter's KV read)
        self.meter.forward("slm", keys, [len(t) for t in fed.values()], [self.slm.lengths[s] for s in fed])
        rid = torch.tensor([r.row_id for r in stepping])
        steps = torch.tensor([r.n_out for r in stepping])
        picked = choose_token_tensor(
            logits, [r.sampling for r in stepping], rid, steps, self.vocab_size
        )  # (b,)
        if self.router is None:
            hard = [False] * len(stepping)
        else:
            assert hidden is not None
            hard = route(
                self.router, self._takes_rows, self.tau, hidden, rid, steps
            ).tolist()  # True: the LLM
        proposal = picked.tolist()
        lps = token_logprobs(logits, proposal, [r.logprobs for r in stepping], self.vocab_size)
        for r, t, to_llm, lp in zip(stepping, proposal, hard, lps, strict=True):
            if to_llm:
                r.waited = 0
            elif self.verify.wants_check(len(r.pending), t in self.eos or r.n_out + 1 >= r.max_new):
                r.waited, r.check, r.check_lp = 0, t, lp  # the proposal is checked in the LLM's call
            else:
                tok[r.key] = (t, False, lp)
        return seconds

    def _llm_call(self, waiting: list[Row], tok: dict[int, tuple[int, bool, TopLogprobs | None]]) -> None:
        """One LLM decode over the waiting rows' unread tokens; its logits write each row's token (verifying: the
        logits at every caught-up position check the row's provisional tokens, :meth:`_verified`)."""
        assert self.llm is not None
        seen = [self.llm.lengths[self.seq_of[r.key]] for r in waiting]
        catch_up = {self.seq_of[r.key]: r.seq[n:] for r, n in zip(waiting, seen, strict=True)}
        t0 = time.perf_counter()
        if (
            self.verify.on
        ):  # the token at seq index t is predicted after index t - 1, chunk index t - 1 - seen
            read = {self.seq_of[r.key]: [t - 1 - n for t in range(r.verified, len(r.seq) + 1)]
                    for r, n in zip(waiting, seen, strict=True)}  # fmt: skip
            logits, _ = self.llm.feed_at(catch_up, read)  # (N, V): every candidate of every row, in row order
        else:
            logits, _ = self.llm.feed(catch_up)  # (R, V)
        self._charge_llm(waiting, seen, [len(t) for t in catch_up.values()], time.perf_counter() - t0)
        if self.verify.on:
            self._verified(waiting, logits, tok)
            return
        rid = torch.tensor([r.row_id for r in waiting])
        steps = torch.tensor([r.n_out for r in waiting])
        chosen = choose_token_tensor(
            logits, [r.sampling for r in waiting], rid, steps, self.vocab_size
        ).tolist()
        lps = token_logprobs(logits, chosen, [r.logprobs for r in waiting], self.vocab_size)
        for r, t, lp in zip(waiting, chosen, lps, strict=True):
            tok[r.key] = (t, True, lp)

    def _verified(
        self, rows: list[Row], flat: torch.Tensor, tok: dict[int, tuple[int, bool, TopLogprobs | None]]
    ) -> None:
        """Check each row's provisional tokens (and a check row's proposal) against the LLM's logits ``flat`` (N, V)
        at every candidate position, the torch session's rule (:func:`~citer.decoding.verify.verdicts`)."""
        for r, v in zip(
            rows, verdicts(rows, candidates(rows), flat, self.vocab_size, self.verify.rho), strict=True
        ):
            self._checked.add(r.key)
            tok[r.key] = (v.token, v.from_llm, v.logprob)
            if v.cut is not None:
                self._rewind(r, v.cut)
            r.check, r.check_lp = None, None

    def _rewind(self, r: Row, t: int) -> None:
        """Take back the row's provisional tokens from seq index ``t`` on; both contexts forget them."""
        assert t >= r.verified and self.llm is not None
        self._replaced[r.key] = r.seq[t:]
        self.meter.rolled_back([r.key], [len(r.seq) - t])
        del r.pending[t - r.verified :]  # before seq: ``verified`` is derived from both
        del r.seq[t:]
        for m in self.models:
            m.rewind(self.seq_of[r.key], t)

    def _emit(self, tok: dict[int, tuple[int, bool, TopLogprobs | None]]) -> list[Emitted]:
        out, done = [], []
        advanced = [r for r in self.rows if r.key in tok]
        self.meter.emitted([r.key for r in advanced], [tok[r.key][1] for r in advanced])
        for r in advanced:
            t, from_llm, lp = tok[r.key]
            r.seq.append(t)
            r.waited = -1
            fin = t in self.eos or r.n_out >= r.max_new
            em = Emitted(
                r.key, t, from_llm, fin, *(lp if lp is not None else (None, None)), self._replaced.get(r.key)
            )
            if self.verify.on and not fin and r.key not in self._checked:
                r.pending.append(em)  # provisional: released once a call checks it or the row finishes
            else:
                out += r.pending
                out.append(em)
                r.pending.clear()
            if fin:
                done.append(r)
        self._retire(done)
        return out

    # -- sequence ids -----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        room = self.room()
        want = len(self.queue) if room is None else min(room, len(self.queue))
        if want == 0:
            return
        if not self.rows:  # no live row: the contexts may grow (emptied) to take the queue's next rows
            batch = list(self.queue)[: min(want, MAX_SEQUENCES)]
            rows = min(
                MAX_SEQUENCES, max(len(batch), 2 * self.max_rows if self.max_rows else len(self.queue))
            )
            need = max(r.prompt_len + r.max_new for r in batch)
            for m in self.models:
                m.fit(rows, 1 << math.ceil(math.log2(need)))  # powers of two: few context rebuilds
            self._free = list(range(min(m.rows for m in self.models)))[::-1]
        per_row = min(m.row_tokens for m in self.models)
        new: list[Row] = []
        while (
            want and self._free and self.queue and self.queue[0].prompt_len + self.queue[0].max_new <= per_row
        ):
            r = self.queue.popleft()  # a row longer than the contexts' rows waits until they are empty
            self.seq_of[r.key] = self._free.pop()
            self.rows.append(r)
            new.append(r)
            want -= 1
        if new and self.llm_prefill == "admit" and self.llm is not None:
            self._llm_prefill(new)

    def _llm_prefill(self, new: list[Row]) -> None:
        """The LLM reads the admitted rows' prompts but their last token in one decode; the last token stays for the
        row's first catch-up, whose logits there choose (or check) its first new token."""
        assert self.llm is not None
        rows = [r for r in new if r.prompt_len > 1]
        if not rows:
            return
        chunks = {self.seq_of[r.key]: r.seq[: r.prompt_len - 1] for r in rows}
        t0 = time.perf_counter()
        self.llm.feed(chunks)
        self._charge_llm(rows, [0] * len(rows), [len(c) for c in chunks.values()], time.perf_counter() - t0)

    def _charge_llm(self, rows: list[Row], seen: list[int], fed: list[int], seconds: float) -> None:
        """Count one LLM decode over ``rows``, which held ``seen`` tokens each and read ``fed`` more, in ``seconds``:
        the session's totals, the engine's measured call times (a measured call rule reads them) and the meter (each
        row's KV read after the call, and how many of the tokens it read were its prompt's)."""
        n = sum(fed)
        self.llm_s += seconds
        self.llm_calls += 1
        self.llm_tokens_read += n
        self.times.llm_call(n, seconds)
        keys = [r.key for r in rows]
        self.meter.forward("llm", keys, fed, [s + f for s, f in zip(seen, fed, strict=True)])
        prompt = [min(f, max(0, r.prompt_len - s)) for r, s, f in zip(rows, seen, fed, strict=True)]
        self.meter.llm_fed(keys, prompt, [f - p for f, p in zip(fed, prompt, strict=True)])

    def _retire(self, rows: list[Row]) -> None:
        for r in rows:
            s = self.seq_of.pop(r.key)
            for m in self.models:
                m.clear(s)
            self._free.append(s)
            self.rows.remove(r)


def routed_generate(
    slm: LlamaCppModel,
    llm: LlamaCppModel | None,
    prompts: Sequence[Sequence[int]],
    router: Callable[..., torch.Tensor] | None,
    tau: float,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = (0.0, 1.0, 0),
    row_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    meter: CostMeter | None = None,
    max_rows: int | None = None,
    rule: CallRule = FixedRule(),
    times: StepTimes | None = None,
) -> RoutedRun:
    """Decode every prompt through a :class:`LlamaCppSession`, a row ending at an id of ``eos_ids`` (kept) or after
    ``max_new_tokens``. ``llm=None`` (and ``router=None``): the first model alone. ``row_ids`` (default 0..n-1) key
    a random router and the sampler; ``vocab_size`` (default the smaller model's) cuts logits before a choice;
    ``meter`` (fresh: rows 0..n-1 in prompt order) is charged every call; ``max_rows`` bounds the SLM's batch;
    ``rule``: when the LLM's queue is called (default at once)."""
    ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"row_ids: need {len(prompts)}, got {len(ids)}")
    if meter is None:
        meter = CostMeter(slm.cost(), llm.cost() if llm is not None else None, 0)
    temperature, top_p, seed = sampling
    sess = LlamaCppSession(
        slm, llm, router, tau, meter=meter, eos_ids=eos_ids, vocab_size=vocab_size, rule=rule, times=times,
        max_rows=max_rows, temperature=temperature, top_p=top_p, seed=seed,
    )  # fmt: skip
    keys = [sess.add(p, max_new_tokens, rid) for p, rid in zip(prompts, ids, strict=True)]
    at = {k: i for i, k in enumerate(keys)}
    run = RoutedRun(tokens=[[] for _ in prompts], from_llm=[[] for _ in prompts])
    while sess.busy:
        for em in sess.step():
            run.tokens[at[em.key]].append(em.token)
            run.from_llm[at[em.key]].append(em.from_llm)
    sess.closed = True
    run.slm_calls, run.llm_calls, run.llm_tokens_read = sess.slm_calls, sess.llm_calls, sess.llm_tokens_read
    run.slm_s, run.llm_s = sess.slm_s, sess.llm_s
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
