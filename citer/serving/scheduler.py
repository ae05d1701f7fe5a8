"""The engine behind the server: one engine thread steps a continuous batch that requests join and leave.

Requests wait in a bounded inbox (``max_queued_requests``; one more is refused with a 429 and a ``Retry-After``
estimated from recent requests). The engine thread moves them into a :class:`~citer.decoding.session.DecodeSession`
whenever the batch has room (``max_batch_rows`` rows), steps it, and hands every token to its request's asyncio
queue as it is chosen -- so answers stream as they are decoded and a new request starts at the next step, not after
the others. A request that stops (a stop string, a client gone) is cancelled and frees its rows' slots. With
``continuous=False`` one request decodes at a time (the old behaviour, kept to compare against).

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
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from citer.decoding.engine import EngineInputError
from citer.serving.access import ServeError
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


@dataclass
class _Decoded:
    """One prompt's answer: text after stop handling, and routing stats."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]


@dataclass(eq=False)
class _Job:
    """One request on its way through the engine; events go to ``events`` on the request's event loop."""

    prompts: list[list[int]]
    s: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    keys: dict[int, int] = field(default_factory=dict)  # session key -> prompt index
    t0: float = field(default_factory=time.perf_counter)

    def post(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (client and server shut down): nobody listens
            pass


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
        self._inbox: deque[_Job] = deque()
        self._cancels: list[tuple[_Job, list[int] | None]] = []
        self._closed = False
        self.active_rows = 0
        self.request_seconds = 1.0  # running estimate of one request's wall time, for Retry-After
        self._sess: Any = None
        self._owner: dict[int, _Job] = {}  # session key -> its request (engine thread only)
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

    def encode(self, texts: list[tuple[str, str]], s: Sampling) -> list[list[int]]:
        """``(text, param)`` pairs as token ids, each checked against the models' context with ``s.max_tokens``."""
        prompts = []
        for i, (text, param) in enumerate(texts):
            ids = self.tok.encode(text, add_special_tokens=False)
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

    def _submit(self, prompts: list[list[int]], s: Sampling) -> _Job:
        """Put one request in the inbox, or refuse it (429) when ``max_queued`` already wait."""
        job = _Job(prompts, s, asyncio.get_running_loop())
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

    def _cancel(self, job: _Job, prompts: list[int] | None = None) -> None:
        """Stop decoding ``prompts`` of ``job`` (all: None); a request still in the inbox just leaves it."""
        with self._cv:
            if prompts is None and job in self._inbox:
                self._inbox.remove(job)
                return
            self._cancels.append((job, prompts))
            self._cv.notify()

    async def answers(
        self,
        texts: list[tuple[str, str]],
        s: Sampling,
        on_piece: Callable[[str, list[bool]], Awaitable[None]] | None = None,
    ) -> list[_Decoded]:
        """Decode ``texts``; ``on_piece`` (single-prompt streams) gets each piece of text as it is decoded.

        Raises :class:`RequestError` before the first piece when the engine refuses the request; if the caller is
        cancelled (a client went away) the request's rows are cancelled and free their slots."""
        prompts = await run_in_threadpool(self.encode, texts, s)
        job = self._submit(prompts, s)
        streams = [TextStream(self.tok, s.stop, self.tok.eos_token_id) for _ in prompts]
        stats: dict[int, Any] = {}
        try:
            while len(stats) < len(prompts):
                kind, i, *rest = await job.events.get()
                if kind == "error":
                    raise rest[0]
                if kind == "done":
                    stats[i] = rest[0]
                    continue
                ts = streams[i]
                if ts.done:  # tokens decoded after a stop string, before the engine saw the cancel
                    continue
                piece = ts.push(*rest)
                if ts.stopped:
                    self._cancel(job, [i])
                if piece is not None and on_piece is not None:
                    await on_piece(*piece)
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
                await on_piece(*tail)
            out.append(
                _Decoded(
                    text=ts.text,
                    finish_reason="stop" if ts.done else "length",
                    prompt_tokens=len(prompts[i]),
                    completion_tokens=len(ts.tokens),
                    stats=row_stats(stats[i], ts.from_llm),
                )
            )
        total = total_stats([d.stats for d in out], getattr(self.engine, "tau", None), wall)
        total.update({k: v for k, v in self.info.items() if k not in total})
        for d in out:
            d.stats = d.stats | {"total": total}
        log.info(
            "decoded %d prompt(s): %d tokens, %.1f%% by the LLM, %d LLM calls, %.3g bytes moved in %.2f s",
            len(prompts),
            sum(d.completion_tokens for d in out),
            100 * total["llm_token_fraction"],
            total["llm_calls"],
            total["bytes_moved"],
            wall,
        )
        return out

    async def stream(self, text: tuple[str, str], s: Sampling) -> AsyncIterator[tuple[str, Any]]:
        """One prompt's answer as ``("piece", (text, flags))`` events, then ``("done", _Decoded)``."""
        q: asyncio.Queue = asyncio.Queue()

        async def on_piece(t: str, f: list[bool]) -> None:
            await q.put(("piece", (t, f)))

        task = asyncio.ensure_future(self.answers([text], s, on_piece))
        task.add_done_callback(lambda _: q.put_nowait(("end", None)))
        try:
            ahead = None
            while True:
                kind, val = ahead or await q.get()
                ahead = None
                if kind == "end":
                    yield "done", task.result()[0]  # re-raises a RequestError
                    return
                # Pieces that queued up while the client was being written to go out as one chunk: under load the
                # stream keeps up with the engine instead of falling behind it.
                text, flags = val
                while not q.empty():
                    ahead = q.get_nowait()
                    if ahead[0] != "piece":
                        break
                    text, flags, ahead = text + ahead[1][0], flags + ahead[1][1], None
                yield "piece", (text, flags)
        finally:
            if not task.done():
                task.cancel()

    def usage(self, ds: list[_Decoded]) -> dict[str, int]:
        p = sum(d.prompt_tokens for d in ds)
        c = sum(d.completion_tokens for d in ds)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

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
            rows = len(sess.rows) + len(sess.queue)
            while self._inbox:
                n = len(self._inbox[0].prompts)
                fits = rows == 0 or (self.continuous and rows + n <= self.max_rows)
                if not fits:
                    break
                admit.append(self._inbox.popleft())
                rows += n
        for job, which in cancels:
            for key, i in list(job.keys.items()):
                if (which is None or i in which) and sess.cancel(key):
                    self._finish(key, i)
        for job in admit:
            self._admit(job)
        out: dict[asyncio.AbstractEventLoop, list[tuple[_Job, tuple[Any, ...]]]] = {}
        if sess.busy:
            # One wake-up of each request loop per step, carrying every row's token, rather than one per token.
            for em in sess.step():
                job = self._owner[em.key]
                i = job.keys[em.key]
                out.setdefault(job.loop, []).append((job, ("tok", i, em.token, em.from_llm)))
                if em.done:
                    self._owner.pop(em.key)
                    out[job.loop].append((job, ("done", i, sess.stats(em.key))))
        with self._cv:  # before the tokens go out: a client reading its first token sees its row counted
            self.active_rows = len(sess.rows)
        for loop, events in out.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # that loop is gone: nobody listens
                pass

    def _admit(self, job: _Job) -> None:
        s = job.s
        try:
            for i, p in enumerate(job.prompts):
                key = self._sess.add(
                    p, s.max_tokens, row_id=i, temperature=s.temperature, top_p=s.top_p, seed=s.seed
                )
                job.keys[key] = i
                self._owner[key] = job
        except EngineInputError as exc:  # the engine's own input checks are the client's fault, not ours
            for key in job.keys:
                self._sess.cancel(key)
                self._owner.pop(key, None)
            job.post("error", -1, RequestError(str(exc), param="prompt"))

    def _finish(self, key: int, i: int) -> None:
        job = self._owner.pop(key)
        job.post("done", i, self._sess.stats(key))

    def _fail_all(self, exc: Exception) -> None:
        for job in {id(j): j for j in self._owner.values()}.values():
            job.post("error", -1, RequestError(f"the engine failed: {exc}", status=500, type_="server_error"))
        self._owner.clear()
        self._sess = None


def _deliver(events: list[tuple[_Job, tuple[Any, ...]]]) -> None:
    for job, ev in events:
        job.events.put_nowait(ev)
