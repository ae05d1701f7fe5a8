"""Rollouts for token-level labels: complete the answer from a prefix plus one chosen token, and grade it.

``encoded`` items are :class:`citer.routing.labels.Encoded` (``prompt``, ``target`` token ids and ``origin``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from citer.data.answers import grade
from citer.data.formats import Format
from citer.decoding.baselines import AlwaysSLM, Router
from citer.decoding.engine import RoutedEngine
from citer.ops.progress import progress
from citer.routing.label_store import LabelsError


@dataclass(frozen=True)
class Branch:
    """Continue example ``ex`` from target[:position] + [token] and grade the final answer."""

    ex: int
    position: int
    token: int


def rollout_order(encoded: Sequence[Any], branches: Sequence[Branch], eos: int) -> list[int]:
    """The branches :func:`rollout_correct` decodes, in its batching order: by prefix length (ties by index), so a
    batch's ragged cache (capacity = longest prompt + new tokens) stays small; an EOS branch decodes nothing."""
    todo = [j for j, br in enumerate(branches) if br.token != eos]
    return sorted(todo, key=lambda j: len(encoded[branches[j].ex].prompt) + branches[j].position)


def rollout_correct(
    engine: Any,
    tokenizer: Any,
    encoded: Sequence[Any],
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    branches: Sequence[Branch],
    batch_size: int,
    max_new_tokens: int,
) -> list[bool]:
    """Greedy-complete every branch through ``engine`` (many prefixes per batch) and grade each answer.

    With verification on (``engine.verify``), the branch's token is the row's provisional first token, not part of
    its prompt: a catch-up may take it back, so the answer says whether the routed decoder *with its checks* ends
    right after the SLM writes this token."""
    eos = int(tokenizer.eos_token_id)
    models = [m for m in (engine.slm, engine.llm) if m is not None]
    max_positions = min(int(m.config.max_position_embeddings) for m in models)
    texts: list[str | None] = [None] * len(branches)
    for j, br in enumerate(branches):
        if br.token == eos:  # the branch ends the answer here: grade what is written, no decoding needed
            texts[j] = tokenizer.decode(encoded[br.ex].target[: br.position], skip_special_tokens=True)
    todo = rollout_order(encoded, branches, eos)
    verified = bool(getattr(engine, "verify", None) and engine.verify.on)
    starts = range(0, len(todo), batch_size)
    for s in progress(starts, desc="labels: rollouts", total=len(starts), unit="batch"):
        chunk = todo[s : s + batch_size]
        prompts = []
        for j in chunk:
            br, e = branches[j], encoded[branches[j].ex]
            prompts.append(e.prompt + e.target[: br.position] + [br.token])
        # The engine refuses prompts that leave no room for max_new_tokens; near the context limit, decode less.
        room = max_positions - max(len(q) for q in prompts)
        if room < 1:
            raise LabelsError(
                f"{encoded[branches[chunk[-1]].ex].origin}: field prompt+target fills the context "
                f"({max_positions} positions); no room to roll out"
            )
        n_new = min(max_new_tokens, room)
        if verified:  # the branch token leads the output (it may be replaced), one more token of budget
            res = engine.generate_batch(
                [q[:-1] for q in prompts], n_new + 1, temperature=0.0, drafts=[q[-1:] for q in prompts]
            )
        else:
            res = engine.generate_batch(prompts, max_new_tokens=n_new, temperature=0.0)
        for j, new in zip(chunk, res.tokens, strict=True):
            br, e = branches[j], encoded[branches[j].ex]
            head = e.target[: br.position] + ([] if verified else [br.token])
            texts[j] = tokenizer.decode(head + list(new), skip_special_tokens=True)
    return [
        bool(grade(t or "", rows[br.ex], fmt))  # encoded[i] is rows[i]
        for t, br in zip(texts, branches, strict=True)
    ]


def rollout_engine(
    slm: Any,
    llm: Any,
    router: Router | None,
    tau: float,
    tokenizer: Any,
    verify: Mapping[str, Any] | None = None,
) -> Any:
    """The engine rollouts decode with: greedy, the tokenizer's EOS/pad/vocabulary; ``router=None``: SLM only.
    ``verify``: :class:`~citer.decoding.engine.RoutedEngine` verification keyword arguments (routed rollouts)."""
    if router is None:  # SLM-only decoding: the engine accepts llm=None with an AlwaysSLM router
        router = AlwaysSLM()
        verify = None
    eos, pad, vocab = int(tokenizer.eos_token_id), pad_id(tokenizer), len(tokenizer)
    return RoutedEngine(
        slm, llm, router, tau=tau, eos_token_id=eos, pad_token_id=pad, vocab_size=vocab, **dict(verify or {})
    )


def pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)
