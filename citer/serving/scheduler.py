"""The engine behind the server: one engine thread steps a continuous batch that requests join and leave.

Requests wait in a bounded inbox (``max_queued_requests``; one more is refused with a 429 and a ``Retry-After``
estimated from recent requests). The engine thread moves them into a :class:`~citer.decoding.session.DecodeSession`
whenever the batch has room (``max_batch_rows`` rows in the SLM's batch; rows waiting for the LLM have left it:
:meth:`~citer.decoding.session.DecodeSession.room`), steps it, and hands every token to its request's asyncio
queue as it is chosen -- so answers stream as they are decoded and a new request starts at the next step, not after
the others. A request that stops (a stop string, a client gone) is cancelled and frees its rows' slots. With
``continuous=False`` one request decodes at a time (the old behaviour, kept to compare against). A scoring request
(echoed prompt log-probs) waits in the same inbox and is scored between two steps (:mod:`citer.decoding.scoring`).

The engine thread holds ``lock`` while it admits and steps; nothing else holds it (tests hold it to stall the
engine). ``/health`` and admission read counters kept under ``_cv``, never the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from citer.decoding.engine import EngineInputError
from citer.decoding.scoring import routed_loglikelihood_batch
from citer.serving.access import ServeError
from citer.serving.jobs import Decoded, Job, deliver
from citer.serving.logprobs import TokenLP
from citer.serving.protocol import RequestError, Sampling, TextStream, check_size, row_stats, total_stats

PromptFormat = Literal["math", "mc", "raw"]
log = logging.getLogger("citer.serving")

# The defaults of ServeParams (citer.config), for build_app and serve called without params.
MAX_PROMPTS_PER_REQUEST = 64
MAX_TOKENS_PER_REQUEST = 65536
MAX_QUEUED_REQUESTS = 32
MAX_BATCH_ROWS = 32
# Retry-After bounds (seconds) of a 429: the expected wait for the queue, estimated from recent requests.
_RETRY_MIN_S, _RETRY_MAX_S = 1, 60
# A session's cost meter keeps a record per row; an idle session is replaced after this many rows.
_ROWS_PER_SESSION = 4096


class _Server:
    """The engine thread, the inbox, and what every endpoint needs to encode, decode and describe answers."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_new_tokens: int,
        fmt: PromptFormat,
        context_length: int | None,
        info: Mapping[str, Any],
        max_prompts: int,
        max_total_tokens: int,
        max_queued: int,
        max_rows: int = MAX_BATCH_ROWS,
        continuous: bool = True,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ServeError(
                "tokenizer: field eos_token is not set; the server cannot tell when an answer ends"
            )
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.max_new_tokens = max_new_tokens
        self.fmt = fmt
        self.context_length = context_length
        self.info = dict(info)
        self.max_prompts = max_prompts
        self.max_total_tokens = max_total_tokens
        self.max_queued = max_queued
        self.max_rows = max_rows
        self.continuous = continuous
        self.lock = threading.Lock()  # held by the engine thread while it admits and steps
        self._cv = threading.Condition()  # guards the fields below; never held across a step
        self._inbox: deque[Job] = deque()
        self._cancels: list[tuple[Job, list[int] | None]] = []
        self._closed = False
        self.active_rows = 0
        self.request_seconds = 1.0  # running estimate of one request's wall time, for Retry-After
        self._sess: Any = None
        self._owner: dict[int, Job] = {}  # session key -> its request (engine thread only)
        self._thread: threading.Thread | None = None
        self.created = int(time.time())

    # -- the request side (event loop) ------------------------------------------------------------------------------
    def check_size(self, n_prompts: int, s: Sampling, *, prompt_param: str, tokens_param: str) -> None:
        check_size(
            n_prompts,
            s.max_tokens,
            max_prompts=self.max_prompts,
            max_total_tokens=self.max_total_tokens,
            prompt_param=prompt_param,
            tokens_param=tokens_param,
        )

    def encode(self, texts: list[tuple[str | list[int], str]], s: Sampling) -> list[list[int]]:
        """``(text or ids, param)`` pairs as token ids, each checked against the models' context with
        ``s.max_tokens``."""
        prompts = []
        vocab = getattr(self.engine, "vocab_size", len(self.tok))
        for i, (text, param) in enumerate(texts):
            ids = list(text) if isinstance(text, list) else self.tok.encode(text, add_special_tokens=False)
            if isinstance(text, list) and not all(0 <= t < vocab for t in ids):
                raise RequestError(f"{param}: token ids must lie in [0, {vocab})", param=param)
            if not ids:
                raise RequestError(f"{param} encodes to no tokens", param=param)
            if self.context_length is not None and len(ids) + s.max_tokens > self.context_length:
                raise RequestError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={s.max_tokens} it exceeds the model's "
                    f"context of {self.context_length} tokens",
                    param="max_tokens",
                )
            prompts.append(ids)
        return prompts

    def queue_state(self) -> dict[str, Any]:
        with self._cv:
            return {
                "busy": self.active_rows > 0,
                "waiting": len(self._inbox),
                "active_rows": self.active_rows,
                "max_queued_requests": self.max_queued,
            }

    def _submit(
        self, prompts: list[list[int]], s: Sampling, score: list[tuple[list[int], list[int]]] | None = None
    ) -> Job:
        """Put one request in the inbox, or refuse it (429) when ``max_queued`` already wait."""
        job = Job(prompts, s, asyncio.get_running_loop(), score)
        with self._cv:
            if len(self._inbox) >= self.max_queued:
                n = len(self._inbox)
                retry = min(_RETRY_MAX_S, max(_RETRY_MIN_S, math.ceil(self.request_seconds * (n + 1))))
                raise RequestError(
                    f"server busy: {n} requests are already waiting for the engine, the most this server queues "
                    f"(serve.max_queued_requests={self.max_queued}); retry in {retry} s",
                    status=429,
                    type_="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                )
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="citer-engine", daemon=True)
                self._thread.start()
            self._inbox.append(job)
            self._cv.notify()
        return job

    def _cancel(self, job: Job, prompts: list[int] | None = None) -> None:
        """Stop decoding ``prompts`` of ``job`` (all: None); a request still in the inbox just leaves it."""
        with self._cv:
            if prompts is None and job in self._inbox:
                self._inbox.remove(job)
                return
            self._cancels.append((job, prompts))
            self._cv.notify()

    async def score(self, items: list[tuple[list[int], list[int]]], top_k: int) -> list[Any]:
        """The routed teacher-forced scores of ``(prompt, continuation)`` id pairs
        (:func:`~citer.decoding.scoring.routed_loglikelihood_batch`), run by the engine thread between steps."""
        s = Sampling(1, 0.0, 1.0, 0, (), False, 1, top_k)
        job = self._submit([], s, score=items)
        try:
            kind, _, val = await job.events.get()
        except BaseException:
            self._cancel(job)
            raise
        if kind == "error":
            raise val
        return val

    async def answers(
        self,
        texts: list[tuple[str | list[int], str]],
        s: Sampling,
        on_piece: Callable[[int, str, list[bool], list[TokenLP]], Awaitable[None]] | None = None,
        prompts: list[list[int]] | None = None,
    ) -> list[Decoded]:
        """Decode ``texts`` (``s.n`` choices each, choice ``prompt * n + sample``); ``on_piece`` (streams) gets
        each choice's pieces of text as they are decoded, with the log-prob entries of their tokens.

        Raises :class:`RequestError` before the first piece when the engine refuses the request; if the caller is
        cancelled (a client went away) the request's rows are cancelled and free their slots."""
        if prompts is None:
            prompts = await run_in_threadpool(self.encode, texts, s)
        job = self._submit(prompts, s)
        streams = [TextStream(self.tok, s.stop, self.tok.eos_token_id) for _ in range(job.rows)]
        entries: list[list[TokenLP]] = [[] for _ in streams]  # per choice: one per token of its text
        sent = [0] * len(streams)
        stats: dict[int, Any] = {}
        try:
            while len(stats) < len(streams):
                kind, i, *rest = await job.events.get()
                if kind == "error":
                    raise rest[0]
                if kind == "done":
                    stats[i] = rest[0]
                    continue
                ts = streams[i]
                if ts.done:  # tokens decoded after a stop string, before the engine saw the cancel
                    continue
                token, from_llm, lp, top = rest
                piece = ts.push(token, from_llm)
                entries[i].append(TokenLP(token, lp, top, from_llm))  # EOS too: harnesses read its log-prob
                if ts.stopped:
                    self._cancel(job, [i])
                if on_piece is not None and (piece is not None or (ts.ended and s.logprobs is not None)):
                    end = len(entries[i]) if ts.ended else sent[i] + len(piece[1])  # type: ignore[index]
                    await on_piece(i, *(piece or ("", [])), entries[i][sent[i] : end])
                    sent[i] = end
        except BaseException:
            self._cancel(job)
            raise
        wall = time.perf_counter() - job.t0
        with self._cv:
            self.request_seconds = 0.7 * self.request_seconds + 0.3 * wall
        out = []
        for i, ts in enumerate(streams):
            tail = ts.finish()
            if tail is not None and on_piece is not None:
                await on_piece(i, tail[0], tail[1], entries[i][sent[i] :])
            out.append(
                Decoded(
                    text=ts.text,
                    finish_reason="stop" if ts.done else "length",
                    prompt_tokens=len(prompts[i // s.n]),
                    completion_tokens=len(ts.tokens),
                    stats=row_stats(stats[i], ts.from_llm),
                    logprobs=entries[i] if s.logprobs is not None else None,
                )
            )
        total = total_stats([d.stats for d in out], getattr(self.engine, "tau", None), wall)
        total.update({k: v for k, v in self.info.items() if k not in total})
        for d in out:
            d.stats = d.stats | {"total": total}
        log.info(
            "decoded %d choice(s): %d tokens, %.1f%% by the LLM, %d LLM calls, %.3g bytes moved in %.2f s",
            len(out),
            sum(d.completion_tokens for d in out),
            100 * total["llm_token_fraction"],
            total["llm_calls"],
            total["bytes_moved"],
            wall,
        )
        return out

    async def stream(
        self, texts: list[tuple[str | list[int], str]], s: Sampling, prompts: list[list[int]] | None = None
    ) -> AsyncIterator[tuple[str, Any]]:
        """The choices' answers as ``("piece", (choice, text, flags, entries))`` events as they are decoded, then
        ``("done", [Decoded per choice])``."""
        q: asyncio.Queue = asyncio.Queue()

        async def on_piece(i: int, t: str, f: list[bool], e: list[TokenLP]) -> None:
            await q.put(("piece", (i, t, f, e)))

        task = asyncio.ensure_future(self.answers(texts, s, on_piece, prompts))
        task.add_done_callback(lambda _: q.put_nowait(("end", None)))
        try:
            ahead = None
            while True:
                kind, val = ahead or await q.get()
                ahead = None
                if kind == "end":
                    yield "done", task.result()  # re-raises a RequestError
                    return
                # A choice's pieces that queued up while the client was being written to go out as one chunk: under
                # load the stream keeps up with the engine instead of falling behind it.
                i, text, flags, ents = val
                while not q.empty():
                    ahead = q.get_nowait()
                    if ahead[0] != "piece" or ahead[1][0] != i:
                        break
                    text, flags, ents = text + ahead[1][1], flags + ahead[1][2], ents + ahead[1][3]
                    ahead = None
                yield "piece", (i, text, flags, ents)
        finally:
            if not task.done():
                task.cancel()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._inbox or self._cancels or self._owner):
                    self._cv.wait()
                if self._closed:
                    return
            with self.lock:
                try:
                    self._turn()
                except Exception as exc:  # a failed step must not take the server down: fail its requests
                    log.exception("engine step failed")
                    self._fail_all(exc)
            # Let the event loop run now: it streams the tokens just posted and admits new requests. Without this
            # the loop waits for the interpreter's switch interval (5 ms), longer than a small model's step.
            time.sleep(0)

    def _turn(self) -> None:
        if self._sess is None or (not self._owner and self._sess.meter.n >= _ROWS_PER_SESSION):
            self._sess = self.engine.session(max_rows=self.max_rows)
        sess = self._sess
        with self._cv:
            cancels, self._cancels = self._cancels, []
            admit = []
            # Rows join while the session has room: its SLM batch (rows waiting for the LLM have left it) is below
            # max_rows, its live rows below twice that (DecodeSession.room).
            live, queued, room = len(sess.rows) + len(sess.queue), len(sess.queue), sess.room()
            while self._inbox:
                n = self._inbox[0].rows
                fits = live == 0 or (self.continuous and (room is None or queued + n <= room))
                if not fits:
                    break
                admit.append(self._inbox.popleft())
                live, queued = live + n, queued + n
        for job, which in cancels:
            for key, i in list(job.keys.items()):
                if (which is None or i in which) and sess.cancel(key):
                    self._finish(key, i)
        for job in admit:
            if job.score is not None:
                self._score(job)
            else:
                self._admit(job)
        out: dict[asyncio.AbstractEventLoop, list[tuple[Job, tuple[Any, ...]]]] = {}
        if sess.busy:
            # One wake-up of each request loop per step, carrying every row's token, rather than one per token.
            for em in sess.step():
                job = self._owner[em.key]
                i = job.keys[em.key]
                ev = ("tok", i, em.token, em.from_llm, em.logprob, em.top_logprobs)
                out.setdefault(job.loop, []).append((job, ev))
                if em.done:
                    self._owner.pop(em.key)
                    out[job.loop].append((job, ("done", i, sess.stats(em.key))))
        with self._cv:  # before the tokens go out: a client reading its first token sees its row counted
            self.active_rows = len(sess.rows)
        for loop, events in out.items():
            try:
                loop.call_soon_threadsafe(deliver, events)
            except RuntimeError:  # that loop is gone: nobody listens
                pass

    def _admit(self, job: Job) -> None:
        s = job.s
        try:
            for i, p in enumerate(job.prompts):
                for c in range(i * s.n, (i + 1) * s.n):  # choice c keys its own draws: n independent samples
                    kw = {
                        "temperature": s.temperature,
                        "top_p": s.top_p,
                        "seed": s.seed,
                        "logprobs": s.logprobs,
                    }
                    key = self._sess.add(p, s.max_tokens, row_id=c, **kw)
                    job.keys[key] = c
                    self._owner[key] = job
        except EngineInputError as exc:  # the engine's own input checks are the client's fault, not ours
            for key in job.keys:
                self._sess.cancel(key)
                self._owner.pop(key, None)
            job.post("error", -1, RequestError(str(exc), param="prompt"))

    def _score(self, job: Job) -> None:
        assert job.score is not None
        try:
            res: Any = routed_loglikelihood_batch(self.engine, job.score, top_k=job.s.logprobs or 0)
        except EngineInputError as exc:
            res = RequestError(str(exc), param="prompt")
        except Exception as exc:  # a failed pass fails this request only
            log.exception("scoring failed")
            res = RequestError(f"the engine failed: {exc}", status=500, type_="server_error")
        job.post("error" if isinstance(res, RequestError) else "scored", -1, res)

    def _finish(self, key: int, i: int) -> None:
        job = self._owner.pop(key)
        job.post("done", i, self._sess.stats(key))

    def _fail_all(self, exc: Exception) -> None:
        for job in {id(j): j for j in self._owner.values()}.values():
            job.post("error", -1, RequestError(f"the engine failed: {exc}", status=500, type_="server_error"))
        self._owner.clear()
        self._sess = None
