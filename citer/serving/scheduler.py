"""The engine behind its lock and its bounded queue: one decode at a time on one engine thread.

A request waiting for its turn holds no thread; at most ``max_queued_requests`` wait, and one more is refused with a
429 and a ``Retry-After`` estimated from recent decodes. What one request may ask is bounded before it is queued.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from citer.decoding.engine import EngineInputError
from citer.serving.access import ServeError
from citer.serving.protocol import (
    RequestError,
    Sampling,
    check_size,
    row_stats,
    stream_pieces,
    total_stats,
    truncate_at_stop,
)

PromptFormat = Literal["math", "mc", "raw"]
log = logging.getLogger("citer.serving")

# The defaults of ServeParams (citer.config), for build_app and serve called without params.
MAX_PROMPTS_PER_REQUEST = 64
MAX_TOKENS_PER_REQUEST = 65536
MAX_QUEUED_REQUESTS = 32
# Retry-After bounds (seconds) of a 429: the expected wait for the queue, estimated from recent decodes.
_RETRY_MIN_S, _RETRY_MAX_S = 1, 60


@dataclass
class _Decoded:
    """One prompt's answer: text after stop handling, its token pieces for streaming, and routing stats."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    pieces: list[tuple[str, list[bool]]]
    stats: dict[str, Any]


class _Server:
    """The engine behind its lock and its queue, plus what every endpoint needs to encode, decode and describe it.

    Decodes run on one engine thread (a single-worker executor), each under ``lock``. ``waiting`` counts requests
    admitted to the queue that do not hold the lock yet; it is changed only under ``_state``, a lock that is never
    held across a decode, so ``/health`` and admission never wait for the engine.
    """

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
        self.lock = threading.Lock()  # the engine: held by the one decode running
        self._state = threading.Lock()  # guards the fields below; never held across a decode
        self.waiting = 0
        self.busy = False
        self.decode_seconds = 1.0  # running estimate of one decode's wall time, for Retry-After
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="citer-engine")
        self.created = int(time.time())

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
        with self._state:
            return {"busy": self.busy, "waiting": self.waiting, "max_queued_requests": self.max_queued}

    def _enqueue(self, prompts: list[list[int]], s: Sampling) -> Future:
        """Admit one decode to the engine queue, or refuse it (429) when ``max_queued`` already wait."""
        with self._state:
            if self.waiting >= self.max_queued:
                n = self.waiting
                retry = min(_RETRY_MAX_S, max(_RETRY_MIN_S, math.ceil(self.decode_seconds * (n + 1))))
                raise RequestError(
                    f"server busy: {n} requests are already waiting for the engine, the most this server queues "
                    f"(serve.max_queued_requests={self.max_queued}); retry in {retry} s",
                    status=429,
                    type_="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                )
            self.waiting += 1
        try:
            fut = self._worker.submit(self._generate, prompts, s)
        except BaseException:
            self._leave_queue()
            raise

        def _cancelled(f: Future) -> None:
            # Cancelled before it ran (the client went away while waiting): _generate never decrements.
            if f.cancelled():
                self._leave_queue()

        fut.add_done_callback(_cancelled)
        return fut

    def _leave_queue(self) -> None:
        with self._state:
            self.waiting -= 1

    def _generate(self, prompts: list[list[int]], s: Sampling) -> tuple[Any, float]:
        """On the engine thread: one ``generate_batch`` under the engine lock."""
        with self.lock:
            with self._state:
                self.waiting -= 1
                self.busy = True
            t0 = time.perf_counter()
            try:
                res = self.engine.generate_batch(
                    prompts,
                    max_new_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    seed=s.seed,
                )
            except EngineInputError as exc:  # the engine's own input checks are the client's fault, not ours
                raise RequestError(str(exc), param="prompt") from exc
            finally:
                wall = time.perf_counter() - t0
                with self._state:
                    self.busy = False
                    self.decode_seconds = 0.7 * self.decode_seconds + 0.3 * wall
        return res, wall

    async def decode(self, texts: list[tuple[str, str]], s: Sampling) -> list[_Decoded]:
        """Encode (a worker thread), wait for the engine (no thread held), decode the answers (a worker thread)."""
        prompts = await run_in_threadpool(self.encode, texts, s)
        res, wall = await asyncio.wrap_future(self._enqueue(prompts, s))
        return await run_in_threadpool(self._answers, prompts, res, wall, s)

    def _answers(self, prompts: list[list[int]], res: Any, wall: float, s: Sampling) -> list[_Decoded]:
        eos = self.tok.eos_token_id
        out = []
        for i, prompt in enumerate(prompts):
            toks, flags = list(res.tokens[i]), list(res.from_llm[i])
            ended = bool(toks) and toks[-1] == eos
            body, body_flags = (toks[:-1], flags[:-1]) if ended else (toks, flags)
            full = self.tok.decode(body, skip_special_tokens=True)
            text, stopped = truncate_at_stop(full, s.stop)
            pieces = stream_pieces(self.tok, body, body_flags, text)
            out.append(
                _Decoded(
                    text=text,
                    finish_reason="stop" if ended or stopped else "length",
                    prompt_tokens=len(prompt),
                    completion_tokens=len(toks),
                    pieces=pieces,
                    stats=row_stats(res.rows[i], flags),
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

    def usage(self, ds: list[_Decoded]) -> dict[str, int]:
        p = sum(d.prompt_tokens for d in ds)
        c = sum(d.completion_tokens for d in ds)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
