"""The evaluation sweep: CITER over a grid of τ and every baseline, on the same examples, through the same engine.

Engine passes (each decodes all examples once): citer x len(taus), citer_s x len(taus), random x len(taus) (p = the
LLM fraction CITER reached at that τ), confidence x len(confidence_thresholds), SLM-only, LLM-only, plus the
optional champion. Query-level routing costs no pass (:mod:`citer.evaluation.query`). Speculative decoding runs
``llm.generate(assistant_model=slm)`` per question (transformers' assisted generation takes batch size 1).

A pass is :mod:`citer.evaluation.passes`; choosing τ and promotion are :mod:`citer.evaluation.promotion`, the
frontier maths :mod:`citer.evaluation.pareto`, the files :mod:`citer.evaluation.report`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from citer.config import SweepParams
from citer.data.formats import Format
from citer.decoding.baselines import AlwaysSLM, ConfidenceRouter, RandomRouter, Router
from citer.decoding.engine import RoutedEngine
from citer.decoding.speculative import speculative_generate
from citer.evaluation.passes import (
    PassResult,
    decode_pass,
    encode_prompts,
    examples_hash,
    speculative_result,
    speculative_row,
    to_row,
)
from citer.evaluation.query import Log, query_rows
from citer.evaluation.rows import SweepError, SweepRow


def run_sweep(
    slm: Any,
    llm: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    routers: Mapping[str, Router],
    params: SweepParams,
    *,
    champion: tuple[Router, float] | None = None,
    log: Log | None = None,
) -> list[SweepRow]:
    """Every method of :data:`METHODS` on the same examples (``routers``: ``citer`` required, ``citer_s``
    optional). ``champion`` = (router, its τ) adds a ``champion`` row for :func:`decide_promotion`."""
    if "citer" not in routers:
        raise SweepError("routers: key 'citer' missing (the trained router is required)")
    unknown = sorted(set(routers) - {"citer", "citer_s"})
    if unknown:
        raise SweepError(f"routers: unknown keys {unknown}; expected 'citer' and optionally 'citer_s'")
    use = list(rows[: params.n_examples] if params.n_examples > 0 else rows)
    if not use:
        raise SweepError("rows: no examples to sweep")
    for r in list(routers.values()) + ([champion[0]] if champion else []):
        if isinstance(r, torch.nn.Module):
            r.eval()
    say = log or (lambda _m: None)
    prompts = encode_prompts(tokenizer, use, fmt)
    ex_hash = examples_hash(prompts, use)
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    gpu, bs, mnt = params.gpu, params.batch_size, params.max_new_tokens
    vocab = len(tokenizer)  # the ids both models share; their embeddings may be padded past it

    def routed(router: Router, tau: float, a: Any = slm, b: Any = llm) -> Any:
        return RoutedEngine(
            a, b, router, tau=tau, eos_token_id=eos, pad_token_id=pad, gpu=gpu, vocab_size=vocab
        )

    def run(name: str, engine: Any, solo_llm: bool = False) -> tuple[PassResult, float]:
        t0 = time.perf_counter()
        res = decode_pass(
            engine,
            tokenizer,
            prompts,
            use,
            fmt,
            bs,
            mnt,
            solo_llm=solo_llm,
            per_query=params.bytes_per == "query",
            desc=f"sweep {name}",
        )
        secs = time.perf_counter() - t0
        say(f"sweep {name}: accuracy {sum(res.correct) / len(res.correct):.3f}, {secs:.1f}s")
        return res, secs

    llm_res, s_llm = run("llm", routed(AlwaysSLM(), 1.0, llm, None), solo_llm=True)
    slm_res, s_slm = run("slm", routed(AlwaysSLM(), 1.0, slm, None))
    out = [
        to_row("llm", None, llm_res, None, ex_hash, pass_seconds=s_llm),
        to_row("slm", None, slm_res, llm_res, ex_hash, pass_seconds=s_slm),
    ]
    for method in ("citer", "citer_s"):
        if method not in routers:
            continue
        for tau in params.taus:
            res, secs = run(f"{method} tau={tau}", routed(routers[method], tau))
            out.append(to_row(method, tau, res, llm_res, ex_hash, pass_seconds=secs))
    # One random point per citer tau, at the LLM fraction that tau reached (matched cost in tokens). Equal
    # fractions (often 0 or 1 at the ends of the grid) decode once: the router's draws depend on p and seed only.
    seen: dict[float, tuple[PassResult, float]] = {}
    for crow in [r for r in out if r.method == "citer"]:
        p = crow.llm_token_fraction
        if p not in seen:
            seen[p] = run(f"random p={p:.3f}", routed(RandomRouter(p, params.seed), 0.5))
        res, secs = seen[p]
        out.append(to_row("random", p, res, llm_res, ex_hash, pass_seconds=secs, matched_citer_tau=crow.tau))
    conf = ConfidenceRouter.from_model(slm, vocab_size=vocab)
    for thr in params.confidence_thresholds:
        res, secs = run(f"confidence thr={thr}", routed(conf, thr))
        out.append(to_row("confidence", thr, res, llm_res, ex_hash, pass_seconds=secs))
    out += query_rows(slm, routers["citer"], prompts, slm_res, llm_res, params, ex_hash, pad, say)
    if params.speculative:
        n_sp = params.speculative_examples or len(use)
        idx = list(range(min(n_sp, len(use))))
        t0 = time.perf_counter()
        outputs = speculative_generate(
            slm,
            llm,
            [prompts[i] for i in idx],
            max_new_tokens=mnt,
            draft_tokens=params.speculative_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            gpu=gpu,
            vocab_size=vocab,
        )
        share = 1 if params.bytes_per == "query" else min(bs, len(use))
        sp, totals = speculative_result(outputs, tokenizer, [use[i] for i in idx], fmt, gpu, share)
        secs = time.perf_counter() - t0
        say(f"sweep speculative: {len(idx)} questions, {secs:.1f}s")
        out.append(speculative_row(sp, llm_res, idx, ex_hash, secs, totals))
    if champion is not None:
        res, secs = run(f"champion tau={champion[1]}", routed(champion[0], champion[1]))
        out.append(to_row("champion", champion[1], res, llm_res, ex_hash, pass_seconds=secs))
    return out
