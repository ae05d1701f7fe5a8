"""The evaluation sweep: CITER over a grid of τ and every baseline, on the same examples, through the same engine.

Engine passes (each decodes all examples once): citer x len(taus), citer_s x len(taus), random x len(taus) (p = the
LLM fraction CITER reached at that τ), confidence x len(confidence_thresholds), SLM-only, LLM-only, plus the
optional champion. Query-level routing costs no pass: each question is answered wholly by one model, so its rows are
picked from the SLM-only and LLM-only passes by the question's score. Speculative decoding runs
``llm.generate(assistant_model=slm)`` per question (transformers' assisted generation takes batch size 1).

Choice of τ, promotion and claims live in :mod:`citer.pareto`, files in :mod:`citer.sweep_report`; both are
re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from citer.config import SweepParams
from citer.data.answers import grade
from citer.data.prompts import Format, build_prompt
from citer.pareto import (  # noqa: F401  (re-exported: the flow imports everything from citer.sweep)
    METHODS,
    SWEEP_KEYS,
    SweepError,
    SweepRow,
    bytes_at_accuracy,
    bytes_saving,
    choose_tau,
    claims,
    decide_promotion,
    dominance,
    frontier,
    llm_reference,
    objective,
)
from citer.sweep_report import (  # noqa: F401
    plot_pareto,
    plot_points,
    read_sweep,
    write_pareto_json,
    write_plot_data,
    write_sweep,
)

Router = Callable[[torch.Tensor], torch.Tensor]
Log = Callable[[str], None]


# ----------------------------------------------------------------------------------------------------------------
# One decoding pass


@dataclass
class PassResult:
    """Per-example outcomes of decoding every example once (lists indexed like the examples)."""

    correct: list[bool]
    n_tokens: list[int]
    llm_tokens: list[int]
    llm_calls: list[int]
    bytes_moved: list[float]
    wall_seconds: float
    gpu_seconds: float  # projected (bytes / bandwidth), see citer.cost
    tokens: list[list[int]] = field(default_factory=list)

    def subset(self, idx: Sequence[int]) -> PassResult:
        return PassResult(
            [self.correct[i] for i in idx],
            [self.n_tokens[i] for i in idx],
            [self.llm_tokens[i] for i in idx],
            [self.llm_calls[i] for i in idx],
            [self.bytes_moved[i] for i in idx],
            self.wall_seconds,
            self.gpu_seconds,
            [self.tokens[i] for i in idx] if self.tokens else [],
        )


def encode_prompts(tokenizer: Any, rows: Sequence[Mapping[str, Any]], fmt: Format) -> list[list[int]]:
    """The prompt ids every method decodes from (no special tokens, as in training)."""
    out = []
    for i, row in enumerate(rows):
        try:
            ids = tokenizer.encode(build_prompt(row, fmt), add_special_tokens=False)
        except KeyError as exc:
            raise SweepError(f"rows: row {i}, field {exc.args[0]!r} missing for format {fmt!r}") from exc
        if not ids:
            raise SweepError(f"rows: row {i}, field prompt encodes to no tokens")
        out.append(list(ids))
    return out


def examples_hash(prompts: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]]) -> str:
    """Identifies the examples a row was measured on (prompts and references)."""
    h = hashlib.sha256()
    h.update(json.dumps([list(p) for p in prompts]).encode())
    h.update(json.dumps([dict(r) for r in rows], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def grade_all(
    tokenizer: Any, tokens: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]], fmt: Format
) -> list[bool]:
    """Whether each decoded answer is right (special tokens dropped before grading)."""
    texts = [tokenizer.decode(list(t), skip_special_tokens=True) for t in tokens]
    return [bool(grade(t, r, fmt)) for t, r in zip(texts, rows, strict=True)]


def _batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    # Similar lengths per batch keep left padding short; the order is fixed, so every pass sees the same batches.
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def decode_pass(
    engine: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    batch_size: int,
    max_new_tokens: int,
    solo_llm: bool = False,
    per_query: bool = True,
) -> PassResult:
    """Decode every prompt greedily through ``engine`` and grade it; time counts decoding only.

    ``solo_llm``: the engine is ``RoutedEngine(llm, None, AlwaysSLM())`` (plain LLM decoding, metered alike).
    ``per_query``: bytes as if each question were decoded alone (``RowStats.bytes_alone``), else the batch's share.
    """
    n = len(prompts)
    res_tokens: list[list[int]] = [[] for _ in range(n)]
    llm_tokens, llm_calls, byts = [0] * n, [0] * n, [0.0] * n
    wall, gpu = 0.0, 0.0
    for idx in _batches(prompts, batch_size):
        t0 = time.perf_counter()
        # row_ids = example indices: the random router's draws then do not depend on how rows are batched.
        res = engine.generate_batch(
            [list(prompts[i]) for i in idx], max_new_tokens=max_new_tokens, temperature=0.0, row_ids=idx
        )
        wall += time.perf_counter() - t0
        gpu += float(res.batch.projected_seconds)
        for i, toks, st in zip(idx, res.tokens, res.rows, strict=True):
            res_tokens[i] = list(toks)
            # A solo LLM engine runs the LLM in the SLM seat: every token and call is the LLM's.
            llm_tokens[i] = len(toks) if solo_llm else int(st.llm_tokens)
            llm_calls[i] = int(st.slm_calls) if solo_llm else int(st.llm_calls)
            byts[i] = float(st.bytes_alone if per_query else st.bytes_moved)
    correct = grade_all(tokenizer, res_tokens, rows, fmt)
    return PassResult(
        correct, [len(t) for t in res_tokens], llm_tokens, llm_calls, byts, wall, gpu, res_tokens
    )


def to_row(
    method: str, tau: float | None, res: PassResult, llm_ref: PassResult | None, ex_hash: str, **extra: Any
) -> SweepRow:
    """Aggregate a pass into a :class:`SweepRow` (``llm_ref`` None: this pass is the LLM-only reference)."""
    ref = llm_ref or res
    n_tok = sum(res.n_tokens)
    b = sum(res.bytes_moved)
    b_ref = sum(ref.bytes_moved)
    return SweepRow(
        method=method,
        tau=None if tau is None else float(tau),
        accuracy=sum(res.correct) / len(res.correct),
        llm_token_fraction=sum(res.llm_tokens) / n_tok if n_tok else 0.0,
        llm_calls=int(sum(res.llm_calls)),
        bytes_moved=float(b),
        bytes_moved_rel_llm=b / b_ref if b_ref > 0 else float("nan"),
        sec_per_token=res.wall_seconds / n_tok if n_tok else float("nan"),
        gpu_sec_per_token=res.gpu_seconds / n_tok if n_tok else None,
        n_examples=len(res.correct),
        n_tokens=int(n_tok),
        llm_accuracy=sum(ref.correct) / len(ref.correct),
        examples_hash=ex_hash,
        extra=dict(extra),
    )


# ----------------------------------------------------------------------------------------------------------------
# Query-level routing (RouteLLM-style): one model per question, chosen from the prompt


@torch.no_grad()
def prompt_scores(
    slm: Any, router: Router, prompts: Sequence[Sequence[int]], batch_size: int, pad_id: int
) -> torch.Tensor:
    """(N,) the router's mean score over the SLM's hidden states at every prompt position."""
    dev = next(slm.parameters()).device
    out = torch.empty(len(prompts))
    decoder = slm.get_decoder()
    for idx in _batches(prompts, batch_size):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)  # (B, T) right-padded
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(prompts[i])] = torch.tensor(list(prompts[i]))
            mask[r, : len(prompts[i])] = 1
        hidden = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state  # (B, T, H)
        valid = mask.bool().to(dev)
        scores = router(hidden[valid]).float().cpu()  # (n_valid,)
        per_row = torch.split(scores, mask.sum(1).tolist())
        for r, i in enumerate(idx):
            out[i] = per_row[r].mean()
    return out


def combine_query(
    slm_res: PassResult,
    llm_res: PassResult,
    to_llm: Sequence[bool],
    extra_bytes: Sequence[float],
    bandwidth: float,
) -> PassResult:
    """Per question, the SLM-only or the LLM-only outcome; ``extra_bytes`` (the SLM's prompt scoring, charged to
    questions sent to the LLM) joins the bytes. Wall time: each pass's time per token x the tokens taken from it."""
    pick = [llm_res if m else slm_res for m in to_llm]
    n = len(to_llm)

    def per_tok(p: PassResult) -> float:
        return p.wall_seconds / max(sum(p.n_tokens), 1)

    byts = [pick[i].bytes_moved[i] + extra_bytes[i] for i in range(n)]
    return PassResult(
        [pick[i].correct[i] for i in range(n)],
        [pick[i].n_tokens[i] for i in range(n)],
        [pick[i].llm_tokens[i] for i in range(n)],
        [pick[i].llm_calls[i] for i in range(n)],
        byts,
        sum(per_tok(p) * p.n_tokens[i] for i, p in enumerate(pick)),
        sum(byts) / bandwidth,
        [pick[i].tokens[i] for i in range(n)],
    )


def scoring_bytes(
    slm: Any, prompts: Sequence[Sequence[int]], batch_size: int, gpu: str, per_query: bool = True
) -> list[float]:
    """Per question, the bytes of the SLM prefill that computes the query router's input (same batches as
    :func:`prompt_scores`, metered by :class:`citer.cost.CostMeter`)."""
    from citer.cost import CostMeter, ModelCost

    meter = CostMeter(ModelCost.from_model(slm), None, len(prompts), gpu)
    for idx in _batches(prompts, batch_size):
        lens = [len(prompts[i]) for i in idx]
        meter.forward("slm", idx, lens, lens)
    rows, _ = meter.finish(0.0)
    return [r.bytes_alone if per_query else r.bytes_moved for r in rows]


# ----------------------------------------------------------------------------------------------------------------
# The sweep


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
    from citer.engine import RoutedEngine
    from citer.routers import AlwaysSLM, ConfidenceRouter, RandomRouter
    from citer.speculative import speculative_pass, speculative_row

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

    def routed(router: Router, tau: float, a: Any = slm, b: Any = llm) -> Any:
        return RoutedEngine(a, b, router, tau=tau, eos_token_id=eos, pad_token_id=pad, gpu=gpu)

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
    conf = ConfidenceRouter.from_model(slm)
    for thr in params.confidence_thresholds:
        res, secs = run(f"confidence thr={thr}", routed(conf, thr))
        out.append(to_row("confidence", thr, res, llm_res, ex_hash, pass_seconds=secs))
    out += _query_rows(slm, routers["citer"], prompts, slm_res, llm_res, params, ex_hash, pad, say)
    if params.speculative:
        n_sp = params.speculative_examples or len(use)
        idx = list(range(min(n_sp, len(use))))
        t0 = time.perf_counter()
        sp, totals = speculative_pass(
            slm,
            llm,
            tokenizer,
            [prompts[i] for i in idx],
            [use[i] for i in idx],
            fmt,
            mnt,
            params.speculative_tokens,
            gpu,
            weight_share=1 if params.bytes_per == "query" else min(bs, len(use)),
        )
        secs = time.perf_counter() - t0
        say(f"sweep speculative: {len(idx)} questions, {secs:.1f}s")
        out.append(speculative_row(sp, llm_res, idx, ex_hash, secs, totals))
    if champion is not None:
        res, secs = run(f"champion tau={champion[1]}", routed(champion[0], champion[1]))
        out.append(to_row("champion", champion[1], res, llm_res, ex_hash, pass_seconds=secs))
    return out


def _query_rows(
    slm: Any,
    router: Router,
    prompts: Sequence[Sequence[int]],
    slm_res: PassResult,
    llm_res: PassResult,
    params: SweepParams,
    ex_hash: str,
    pad: int,
    say: Log,
) -> list[SweepRow]:
    """Query-level routing: the questions with the lowest mean router score over their prompt go to the LLM."""
    from citer.cost import GPU_BANDWIDTH

    t0 = time.perf_counter()
    scores = prompt_scores(slm, router, prompts, params.batch_size, pad)  # (N,)
    extra = scoring_bytes(slm, prompts, params.batch_size, params.gpu, params.bytes_per == "query")
    secs = time.perf_counter() - t0
    n = len(prompts)
    order = sorted(range(n), key=lambda i: (float(scores[i]), i))
    out = []
    for q in params.query_llm_fractions:
        k = round(q * n)
        to_llm = [False] * n
        for i in order[:k]:
            to_llm[i] = True
        # The threshold that splits the sorted scores at k (midpoint; the ends are 0 and 1).
        lo = float(scores[order[k - 1]]) if k > 0 else 0.0
        hi = float(scores[order[k]]) if k < n else 1.0
        res = combine_query(
            slm_res,
            llm_res,
            to_llm,
            [extra[i] if to_llm[i] else 0.0 for i in range(n)],
            GPU_BANDWIDTH[params.gpu],
        )
        res.wall_seconds += secs * k / n  # scoring time of the questions sent to the LLM
        out.append(to_row("query", (lo + hi) / 2, res, llm_res, ex_hash, question_llm_fraction=k / n))
    say(f"sweep query: {len(out)} points from the SLM/LLM passes, scoring {secs:.1f}s")
    return out
