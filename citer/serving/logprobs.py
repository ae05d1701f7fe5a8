"""Log-probs in OpenAI's two shapes: the completions' parallel lists and the chat's per-token objects.

Each token's log-prob comes from the model that wrote it (a generated token) or whose distribution the router chose
to score it (an echoed prompt token, :mod:`citer.decoding.scoring`); ``from_llm`` beside it says which: true for the
LLM, false for the SLM, null for a prompt's first token, which nothing scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class TokenLP(NamedTuple):
    token: int
    logprob: float | None  # None: the first token of an echoed prompt
    top: list[tuple[int, float]] | None  # the likeliest (token, logprob) of the distribution that scored it
    from_llm: bool | None


def token_text(tok: Any, token: int, skip_special: bool = False) -> str:
    """A token's text alone (a byte-level piece of a longer character decodes to U+FFFD, as in other servers).
    A generated token's is read as the answer's text is (``skip_special``), so the tokens add up to the text."""
    return tok.decode([token], skip_special_tokens=skip_special)


def prompt_entries(ids: Sequence[int], scores: Any | None) -> list[TokenLP]:
    """An echoed prompt's tokens: the first unscored, the rest from ``scores`` (a
    :class:`~citer.decoding.scoring.TokenScores` of ``ids[1:]`` after ``ids[:1]``, None for a one-token prompt)."""
    out = [TokenLP(int(ids[0]), None, None, None)]
    if scores is not None:
        tops = scores.top or [[] for _ in scores.logprobs]
        for t, lp, top, llm in zip(ids[1:], scores.logprobs, tops, scores.from_llm, strict=True):
            out.append(TokenLP(int(t), float(lp), list(top), bool(llm)))
    return out


def completion_logprobs(
    tok: Any, entries: Sequence[TokenLP], offset: int = 0, n_prompt: int = 0
) -> dict[str, Any]:
    """The completions ``logprobs`` object; the first ``n_prompt`` entries are an echoed prompt's, the rest generated;
    ``text_offset`` counts characters from ``offset`` (the start of the choice's text within prompt + text)."""
    tokens, offsets, tops = [], [], []
    for j, e in enumerate(entries):
        s = token_text(tok, e.token, skip_special=j >= n_prompt)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e.top is None:
            tops.append(None)
        else:
            d: dict[str, float] = {}
            for t, lp in e.top:  # two ids of one text keep the likelier log-prob, so greedy checks stay right
                d.setdefault(token_text(tok, t), lp)
            tops.append(d)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
        "from_llm": [e.from_llm for e in entries],
    }


def _chat_token(tok: Any, token: int, logprob: float, skip_special: bool = False) -> dict[str, Any]:
    s = token_text(tok, token, skip_special)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tok: Any, entries: Sequence[TokenLP]) -> dict[str, Any]:
    """The chat ``logprobs`` object: one item per generated token, ``from_llm`` in each."""
    content = []
    for e in entries:
        item = _chat_token(tok, e.token, float(e.logprob or 0.0), skip_special=True)
        item["top_logprobs"] = [_chat_token(tok, t, lp) for t, lp in (e.top or [])]
        item["from_llm"] = e.from_llm
        content.append(item)
    return {"content": content, "refusal": None}
