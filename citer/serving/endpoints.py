"""The two generation endpoints' work: a checked request in, OpenAI's response body (or its stream) out.

``/v1/completions`` takes text or token ids (one prompt or several); ``n`` choices per prompt are independent seeded
samples (choice ``prompt * n + sample`` keys its own draws), decoded as rows of the running batch. ``logprobs``
reports each token's log-prob from the model that wrote it; ``echo`` with ``logprobs`` adds the prompt's tokens,
scored teacher-forced by the routed policy (:mod:`citer.decoding.scoring`), and ``max_tokens`` 0 then scores without
generating: a loglikelihood request of an evaluation harness.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool

from citer.serving.jobs import Decoded, usage
from citer.serving.logprobs import TokenLP, chat_logprobs, completion_logprobs, prompt_entries
from citer.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    chat_prompt,
    check_model,
    check_size,
    sampling_of,
)
from citer.serving.scheduler import _Server
from citer.serving.streaming import stream_response


def _citer(ds: list[Decoded]) -> dict[str, Any]:
    return dict(ds[0].stats["total"])


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # one prompt of token ids
    return list(prompt)


def _echo_stats(entries: list[list[TokenLP]]) -> dict[str, Any]:
    flags = [e.from_llm for es in entries for e in es if e.from_llm is not None]
    n_llm = sum(flags)
    return {"tokens_by_model": {"slm": len(flags) - n_llm, "llm": n_llm}}


async def completions(srv: _Server, req: CompletionRequest) -> Any:
    check_model(req.model, srv.model_name)
    texts = _prompt_list(req.prompt)
    if not texts:
        raise RequestError("prompt is an empty list", param="prompt")
    # The count first: a request of 20,000 prompts is refused before anything else is looked at.
    check_size(len(texts), None, max_prompts=srv.max_prompts, max_total_tokens=srv.max_total_tokens)
    s = sampling_of(req, srv.max_new_tokens)
    srv.check_size(len(texts) * s.n, s, prompt_param="prompt", tokens_param="max_tokens")
    if req.stream and s.max_tokens == 0:
        raise RequestError(
            "stream=true needs max_tokens >= 1: nothing would be generated", param="max_tokens"
        )
    params = ["prompt"] if len(texts) == 1 else [f"prompt[{i}]" for i in range(len(texts))]
    pairs = list(zip(texts, params, strict=True))
    prompts = await run_in_threadpool(srv.encode, pairs, s)
    shown = [t if isinstance(t, str) else srv.tok.decode(t, skip_special_tokens=False) for t in texts]
    echo_lp = None
    if s.echo and s.logprobs is not None:
        # Each prompt scored after its first token: one SLM pass and at most one LLM pass for all of them.
        items = [(p[:1], p[1:]) for p in prompts if len(p) > 1]
        scored = iter(await srv.score(items, s.logprobs) if items else [])
        echo_lp = [prompt_entries(p, next(scored) if len(p) > 1 else None) for p in prompts]
    if req.stream:
        return await stream_response(srv, pairs, s, chat=False, prompts=prompts, shown=shown, echo_lp=echo_lp)
    if s.max_tokens == 0:  # echo only: the prompts' scores, nothing generated
        ds = [
            Decoded(
                "", "length", len(p), 0, {"total": {"tau": getattr(srv.engine, "tau", None), **srv.info}}, []
            )
            for p in prompts
            for _ in range(s.n)
        ]
    else:
        ds = await srv.answers(pairs, s, prompts=prompts)
    choices = []
    for c, d in enumerate(ds):
        i = c // s.n
        lp = None
        if s.logprobs is not None:
            head = echo_lp[i] if echo_lp is not None else []
            lp = completion_logprobs(
                srv.tok, head + (d.logprobs or []), 0 if s.echo else len(shown[i]), len(head)
            )
        text = (shown[i] if s.echo else "") + d.text
        choices.append({"index": c, "text": text, "logprobs": lp, "finish_reason": d.finish_reason})
    stats = _citer(ds)
    if echo_lp is not None:
        stats["echo"] = _echo_stats(echo_lp)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": srv.model_name,
        "choices": choices,
        "usage": usage(ds, s.n),
        "citer": stats,
    }


async def chat_completions(srv: _Server, req: ChatRequest) -> Any:
    check_model(req.model, srv.model_name)
    s = sampling_of(req, srv.max_new_tokens)
    tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    srv.check_size(s.n, s, prompt_param="messages", tokens_param=tokens_param)
    text = (chat_prompt(req.messages, srv.fmt, srv.tok), "messages")
    if req.stream:
        return await stream_response(srv, [text], s, chat=True)
    ds = await srv.answers([text], s)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": srv.model_name,
        "choices": [
            {
                "index": c,
                "message": {"role": "assistant", "content": d.text},
                "logprobs": chat_logprobs(srv.tok, d.logprobs or []) if s.logprobs is not None else None,
                "finish_reason": d.finish_reason,
            }
            for c, d in enumerate(ds)
        ],
        "usage": usage(ds, s.n),
        "citer": _citer(ds),
    }
