"""Routed decoding with both models on llama.cpp (:class:`~citer.decoding.llama_cpp_runner.LlamaCppModel`): the SLM
steps every live row in one batched decode, the router reads the hidden states llama.cpp returns, and the rows it
sends to the LLM catch up in one batched decode of the tokens the LLM has not read yet, whose last logits write the
token. The decision is :func:`~citer.decoding.decide.route` and the token choice the engine's sampler, keyed on
(row id, tokens written) as in :class:`~citer.decoding.engine.RoutedEngine`, so a router and τ chosen with the
torch engine decide the same way here.

Shapes: b = live rows, R = routed rows, V = vocabulary, H = the SLM's hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from citer.decoding.baselines import wants_row_ids
from citer.decoding.decide import Sampling, route
from citer.decoding.llama_cpp_runner import LlamaCppModel
from citer.decoding.sampling import select_tokens


@dataclass
class RoutedRun:
    """Per prompt, the tokens written and which the LLM wrote; the calls each model ran."""

    tokens: list[list[int]] = field(default_factory=list)
    from_llm: list[list[bool]] = field(default_factory=list)
    slm_calls: int = 0
    llm_calls: int = 0
    llm_tokens_read: int = 0  # catch-up tokens (prompts included) the LLM read
    slm_s: float = 0.0  # seconds inside each model's decodes
    llm_s: float = 0.0

    @property
    def llm_fraction(self) -> float:
        n = sum(len(x) for x in self.from_llm)
        return sum(sum(x) for x in self.from_llm) / n if n else 0.0


def routed_generate(
    slm: LlamaCppModel,
    llm: LlamaCppModel,
    prompts: Sequence[Sequence[int]],
    router: Callable[..., torch.Tensor],
    tau: float,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = (0.0, 1.0, 0),
    row_ids: Sequence[int] | None = None,
) -> RoutedRun:
    """Decode every prompt, ``min(slm.rows, llm.rows)`` rows at a time, a row ending at an id of ``eos_ids`` (kept)
    or after ``max_new_tokens``. ``row_ids`` (default 0..n-1) key a random router and the sampler."""
    if not slm.hidden:
        raise ValueError(f"{slm.path.name}: the SLM's context must return hidden states (hidden=True)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"row_ids: need {len(prompts)}, got {len(ids)}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        need = len(p) + max_new_tokens
        if need > min(slm.row_tokens, llm.row_tokens):
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + {max_new_tokens} new exceed the contexts' "
                f"{min(slm.row_tokens, llm.row_tokens)} tokens per row"
            )
    vocab = min(slm.vocab_size, llm.vocab_size)
    takes_rows = wants_row_ids(router)
    eos = set(int(e) for e in eos_ids)
    run = RoutedRun()
    rows = min(slm.rows, llm.rows)
    for lo in range(0, len(prompts), rows):
        chunk = range(lo, min(lo + rows, len(prompts)))
        _decode_chunk(slm, llm, [list(map(int, prompts[i])) for i in chunk], [ids[i] for i in chunk],
                      router, takes_rows, tau, max_new_tokens, eos, sampling, vocab, run)  # fmt: skip
    return run


def _decode_chunk(
    slm: LlamaCppModel,
    llm: LlamaCppModel,
    prompts: list[list[int]],
    ids: list[int],
    router: Callable[..., torch.Tensor],
    takes_rows: bool,
    tau: float,
    max_new_tokens: int,
    eos: set[int],
    sampling: Sampling,
    vocab: int,
    run: RoutedRun,
) -> None:
    slm.reset()
    llm.reset()
    temperature, top_p, seed = sampling
    seqs = [list(p) for p in prompts]  # prompt + tokens written, per row (= the row's context sequence id)
    written: list[list[int]] = [[] for _ in prompts]
    by_llm: list[list[bool]] = [[] for _ in prompts]
    feed = {r: list(p) for r, p in enumerate(prompts)}  # what the SLM has not read yet
    while feed:
        live = list(feed)
        t0 = time.perf_counter()
        logits, hidden = slm.feed(feed)  # (b, V), (b, H)
        run.slm_s += time.perf_counter() - t0
        run.slm_calls += 1
        assert hidden is not None
        rid = torch.tensor([ids[r] for r in live])
        steps = torch.tensor([len(written[r]) for r in live])
        hard = route(router, takes_rows, tau, hidden, rid, steps)  # (b,) True: the LLM writes
        picked = select_tokens(logits[:, :vocab], temperature, top_p, seed, rid, steps)  # (b,)
        sent = hard.nonzero().flatten().tolist()
        if sent:
            catch_up = {live[i]: seqs[live[i]][llm.lengths[live[i]] :] for i in sent}
            run.llm_tokens_read += sum(len(t) for t in catch_up.values())
            t0 = time.perf_counter()
            llm_logits, _ = llm.feed(catch_up)  # (R, V)
            run.llm_s += time.perf_counter() - t0
            run.llm_calls += 1
            picked[sent] = select_tokens(
                llm_logits[:, :vocab], temperature, top_p, seed, rid[sent], steps[sent]
            )
        flags = hard.tolist()
        feed = {}
        for i, r in enumerate(live):
            t = int(picked[i])
            written[r].append(t)
            by_llm[r].append(bool(flags[i]))
            seqs[r].append(t)
            if t not in eos and len(written[r]) < max_new_tokens:
                feed[r] = [t]
    run.tokens.extend(written)
    run.from_llm.extend(by_llm)


def solo_generate(
    model: LlamaCppModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = (0.0, 1.0, 0),
    row_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """One model alone, ``model.rows`` rows at a time, sampled as :func:`routed_generate` samples: the baseline a
    routed pair on llama.cpp races (the LLM alone), and the tokens a routed run must equal when nothing or everything
    is routed."""
    ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
    temperature, top_p, seed = sampling
    eos = set(int(e) for e in eos_ids)
    out: list[list[int]] = []
    for lo in range(0, len(prompts), model.rows):
        chunk = list(range(lo, min(lo + model.rows, len(prompts))))
        model.reset()
        written: list[list[int]] = [[] for _ in chunk]
        feed = {r: list(map(int, prompts[i])) for r, i in enumerate(chunk)}
        while feed:
            live = list(feed)
            logits, _ = model.feed(feed)
            rid = torch.tensor([ids[chunk[r]] for r in live])
            steps = torch.tensor([len(written[r]) for r in live])
            picked = select_tokens(logits, temperature, top_p, seed, rid, steps).tolist()
            feed = {}
            for r, t in zip(live, picked, strict=True):
                written[r].append(int(t))
                if t not in eos and len(written[r]) < max_new_tokens:
                    feed[r] = [int(t)]
        out.extend(written)
    return out
