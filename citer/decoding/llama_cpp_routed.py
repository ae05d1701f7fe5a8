"""Routed decoding with both models on llama.cpp (:class:`~citer.decoding.llama_cpp_runner.LlamaCppModel`): the SLM
steps every live row in one batched decode, the router reads the hidden states llama.cpp returns, and the rows it
sends to the LLM catch up in one batched decode of the tokens the LLM has not read yet, whose last logits write the
token. The decision is :func:`~citer.decoding.decide.route` and the token choice the engine's sampler, keyed on
(row id, tokens written) as in :class:`~citer.decoding.engine.RoutedEngine`, so a router and τ chosen with the
torch engine decide the same way here. Rows join as others finish (a context's sequence ids are its slots).

Shapes: b = live rows, R = routed rows, V = vocabulary, H = the SLM's hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from citer.decoding.baselines import wants_row_ids
from citer.decoding.cost import CostMeter
from citer.decoding.decide import Sampling, route
from citer.decoding.llama_cpp_runner import LlamaCppModel
from citer.decoding.sampling import select_tokens


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
) -> RoutedRun:
    """Decode every prompt, at most ``slm.rows`` (and ``llm.rows``) at once, a row ending at an id of ``eos_ids``
    (kept) or after ``max_new_tokens``. ``llm=None`` (and ``router=None``): the first model alone. ``row_ids``
    (default 0..n-1) key a random router and the sampler; ``vocab_size`` (default the smaller model's) cuts logits
    before a choice; ``meter`` (rows 0..n-1 in prompt order) is charged every call; ``max_rows``: fewer rows at once
    than the contexts hold."""
    if llm is not None and not slm.hidden:
        raise ValueError(f"{slm.path.name}: the SLM's context must return hidden states (hidden=True)")
    if (llm is None) != (router is None):
        raise ValueError("a router needs an LLM to route to, and an LLM a router")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"row_ids: need {len(prompts)}, got {len(ids)}")
    models = [slm] if llm is None else [slm, llm]
    per_row = min(m.row_tokens for m in models)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > per_row:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + {max_new_tokens} new exceed the contexts' {per_row} tokens per row"
            )
    vocab = vocab_size or min(m.vocab_size for m in models)
    takes_rows = router is not None and wants_row_ids(router)
    temperature, top_p, seed = sampling
    eos = {int(e) for e in eos_ids}
    run = RoutedRun(tokens=[[] for _ in prompts], from_llm=[[] for _ in prompts])
    seqs = [list(map(int, p)) for p in prompts]  # prompt + tokens written, per prompt
    todo = list(range(len(prompts)))[::-1]  # prompts not started, next last
    slot_of: dict[int, int] = {}  # prompt -> the sequence id it holds in both contexts
    free = list(range(min([m.rows for m in models] + ([max_rows] if max_rows else []))))[::-1]
    for m in models:
        m.reset()
    feed: dict[int, list[int]] = {}  # prompt -> tokens the SLM has not read
    while todo or feed:
        while todo and free:  # rows join as others leave
            i = todo.pop()
            slot_of[i] = free.pop()
            feed[i] = list(seqs[i])
        live = list(feed)
        slots = [slot_of[i] for i in live]
        before = [slm.lengths[s] for s in slots]
        t0 = time.perf_counter()
        logits, hidden = slm.feed({slot_of[i]: feed[i] for i in live})  # (b, V), (b, H)
        run.slm_s += time.perf_counter() - t0
        run.slm_calls += 1
        if meter is not None:
            meter.forward("slm", live, [len(feed[i]) for i in live], before)
        rid = torch.tensor([ids[i] for i in live])
        steps = torch.tensor([len(run.tokens[i]) for i in live])
        picked = select_tokens(logits[:, :vocab], temperature, top_p, seed, rid, steps)  # (b,)
        if llm is None or router is None:
            hard = torch.zeros(len(live), dtype=torch.bool)
        else:
            assert hidden is not None
            hard = route(router, takes_rows, tau, hidden, rid, steps)  # (b,) True: the LLM writes
        sent = hard.nonzero().flatten().tolist()
        if sent and llm is not None:
            rows = [live[k] for k in sent]
            seen = [llm.lengths[slot_of[i]] for i in rows]
            catch_up = {slot_of[i]: seqs[i][n:] for i, n in zip(rows, seen, strict=True)}
            run.llm_tokens_read += sum(len(t) for t in catch_up.values())
            t0 = time.perf_counter()
            llm_logits, _ = llm.feed(catch_up)  # (R, V)
            run.llm_s += time.perf_counter() - t0
            run.llm_calls += 1
            if meter is not None:
                fed = [len(t) for t in catch_up.values()]
                meter.forward("llm", rows, fed, seen)
                prompt = [max(0, len(prompts[i]) - n) for i, n in zip(rows, seen, strict=True)]
                meter.llm_fed(rows, prompt, [f - p for f, p in zip(fed, prompt, strict=True)])
            picked[sent] = select_tokens(
                llm_logits[:, :vocab], temperature, top_p, seed, rid[sent], steps[sent]
            )
        flags = hard.tolist()
        if meter is not None:
            meter.emitted(live, flags)
            meter.step([])
        feed = {}
        for k, i in enumerate(live):
            t = int(picked[k])
            run.tokens[i].append(t)
            run.from_llm[i].append(bool(flags[k]))
            seqs[i].append(t)
            if t not in eos and len(run.tokens[i]) < max_new_tokens:
                feed[i] = [t]
            else:  # the row leaves; its slot takes the next prompt
                for m in models:
                    m.clear(slot_of[i])
                free.append(slot_of.pop(i))
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
