"""The evaluation sweep: every method chosen on dev, reported on test, through the same engine and cost model.

Protocol (nothing is tuned on test):
1. dev: LLM-only and SLM-only passes; each threshold method's scores at the decision positions of the SLM's own dev
   answers give its τ at every ``sweep.llm_fractions`` value (:mod:`citer.evaluation.thresholds`); the query router
   is trained on train questions and thresholded on dev questions (:mod:`citer.evaluation.query`).
2. dev: one pass per (method, τ) and per random fraction; the rule picks each method's operating point.
3. test: the same (method, τ) points, plus the oracle bound (:mod:`citer.evaluation.oracle`) and speculative decoding
   on the whole split; the dev-chosen point of every method is marked ``selected_on_dev``. The re-evaluated champion
   runs on test only at the τ its own dev pass chose.

Every byte figure is per question as if decoded alone (batch 1), router reads included; the batch-shared figures sit
in their own ``*_batch*`` columns. A pass is :mod:`citer.evaluation.passes`; the rule and promotion
:mod:`citer.evaluation.promotion`; frontiers, claims and intervals :mod:`citer.evaluation.pareto` and
:mod:`citer.evaluation.intervals`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from citer.config import SweepParams
from citer.data.formats import Format
from citer.decoding.baselines import AlwaysSLM, ConfidenceRouter, RandomRouter, Router
from citer.decoding.cost import GPU_BANDWIDTH
from citer.decoding.engine import RoutedEngine
from citer.decoding.speculative import speculative_generate
from citer.evaluation.oracle import OracleRouter, oracle_flags, oracle_summary
from citer.evaluation.passes import (
    PassResult,
    decode_pass,
    encode_prompts,
    examples_hash,
    speculative_result,
    speculative_row,
    to_row,
)
from citer.evaluation.promotion import best_row
from citer.evaluation.query import (
    combine_query,
    prompt_features,
    query_decisions,
    scoring_bytes,
    train_query_router,
)
from citer.evaluation.rows import SweepError, SweepRow
from citer.evaluation.thresholds import method_scores, quantile_table, taus_at_fractions

Log = Callable[[str], None]
ROUTER_KEYS = ("citer", "citer_iter1", "citer_s", "citer_emb", "citer_logits", "citer_emb_logits")


@dataclass
class SweepResult:
    """Both splits' rows, each method's thresholds and dev quantiles, and the point the rule chose on dev."""

    dev: list[SweepRow]
    test: list[SweepRow]
    thresholds: dict[str, list[tuple[float, float]]]  # method -> [(target LLM fraction, τ)]
    quantiles: dict[str, list[float]]  # method -> τ at fractions 0, 0.01, ..., 1 of its dev scores
    chosen: dict[
        str, SweepRow | None
    ]  # method -> its dev row the rule picked (None: no point meets the rule)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Split:
    rows: list[Mapping[str, Any]]
    prompts: list[list[int]]
    ex_hash: str


class _Runner:
    """Decoding passes over one split with the shared engine settings."""

    def __init__(
        self, slm: Any, llm: Any, tokenizer: Any, fmt: Format, params: SweepParams, say: Log
    ) -> None:
        self.slm, self.llm, self.tok, self.fmt, self.p, self.say = slm, llm, tokenizer, fmt, params, say
        self.eos = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.eos
        self.vocab = len(tokenizer)  # the ids both models share; their embeddings may be padded past it

    def engine(self, router: Router, tau: float, a: Any = None, b: Any = "llm") -> RoutedEngine:
        return RoutedEngine(
            a if a is not None else self.slm,
            self.llm if b == "llm" else b,
            router,
            tau=tau,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            gpu=self.p.gpu,
            vocab_size=self.vocab,
        )

    def run(
        self, split: _Split, name: str, engine: RoutedEngine, solo_llm: bool = False
    ) -> tuple[PassResult, float]:
        t0 = time.perf_counter()
        res = decode_pass(
            engine,
            self.tok,
            split.prompts,
            split.rows,
            self.fmt,
            self.p.batch_size,
            self.p.max_new_tokens,
            solo_llm=solo_llm,
            desc=f"sweep {name}",
        )
        secs = time.perf_counter() - t0
        self.say(f"sweep {name}: accuracy {sum(res.correct) / len(res.correct):.3f}, {secs:.1f}s")
        return res, secs

    def references(self, split: _Split, tag: str) -> tuple[PassResult, PassResult, list[SweepRow]]:
        llm_res, s_llm = self.run(
            split, f"{tag} llm", self.engine(AlwaysSLM(), 1.0, self.llm, None), solo_llm=True
        )
        slm_res, s_slm = self.run(split, f"{tag} slm", self.engine(AlwaysSLM(), 1.0, self.slm, None))
        rows = [
            to_row("llm", None, llm_res, None, split.ex_hash, pass_seconds=s_llm),
            to_row("slm", None, slm_res, llm_res, split.ex_hash, pass_seconds=s_slm),
        ]
        return llm_res, slm_res, rows


def _split(tokenizer: Any, rows: Sequence[Mapping[str, Any]], fmt: Format, n: int, name: str) -> _Split:
    use = list(rows[:n] if n > 0 else rows)
    if not use:
        raise SweepError(f"{name}: no examples to sweep")
    prompts = encode_prompts(tokenizer, use, fmt)
    return _Split(use, prompts, examples_hash(prompts, use))


def _query_rows(
    runner: _Runner,
    split: _Split,
    scores: Any,
    taus: Sequence[tuple[float, float]],
    slm_res: PassResult,
    llm_res: PassResult,
    weight_bytes: int,
) -> list[SweepRow]:
    extra = scoring_bytes(runner.slm, split.prompts, weight_bytes, runner.p.gpu)
    out = []
    for f, tau in taus:
        to_llm = query_decisions(scores, tau)
        charged = [e if m else 0.0 for e, m in zip(extra, to_llm, strict=True)]
        res = combine_query(slm_res, llm_res, to_llm, charged, GPU_BANDWIDTH[runner.p.gpu])
        row = to_row("query", tau, res, llm_res, split.ex_hash, target_llm_fraction=f)
        row.extra["question_llm_fraction"] = sum(to_llm) / len(to_llm)
        out.append(row)
    return out


# (method, target LLM-token fraction, router, engine τ, the row's τ)
_Point = tuple[str, float, Router, float, float]


def _points(
    scored: Mapping[str, Router], thresholds: Mapping[str, Sequence[tuple[float, float]]], params: SweepParams
) -> list[_Point]:
    """Every threshold method at its (fraction, τ) points, then random routing at each fraction (its τ is p)."""
    pts = [(m, f, router, tau, tau) for m, router in scored.items() for f, tau in thresholds[m]]
    return pts + [("random", f, RandomRouter(f, params.seed), 0.5, f) for f in params.llm_fractions]


def _threshold_rows(
    run: _Runner, split: _Split, tag: str, llm_res: PassResult, points: Sequence[_Point]
) -> list[SweepRow]:
    out = []
    for m, f, router, tau, row_tau in points:
        word = "p" if m == "random" else "f"
        res, secs = run.run(split, f"{tag} {m} {word}={f:g}", run.engine(router, tau))
        out.append(to_row(m, row_tau, res, llm_res, split.ex_hash, pass_seconds=secs, target_llm_fraction=f))
    return out


def run_sweep(
    slm: Any,
    llm: Any,
    tokenizer: Any,
    dev_rows: Sequence[Mapping[str, Any]],
    test_rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    routers: Mapping[str, Router],
    params: SweepParams,
    *,
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    champion: Router | None = None,
    log: Log | None = None,
) -> SweepResult:
    """Every method on dev (to choose) and test (to report). ``routers``: ``citer`` required, any of
    :data:`ROUTER_KEYS` optional. ``train_rows`` trains the query-level router (omitted: no query method).
    ``champion`` (the registered router holding the alias) is thresholded and chosen on dev like the candidate and
    re-evaluated on the same test examples."""
    if "citer" not in routers:
        raise SweepError("routers: key 'citer' missing (the trained router is required)")
    unknown = sorted(set(routers) - set(ROUTER_KEYS))
    if unknown:
        raise SweepError(f"routers: unknown keys {unknown}; expected some of {list(ROUTER_KEYS)}")
    for r in [*routers.values(), champion]:
        if isinstance(r, torch.nn.Module):
            r.eval()
    say = log or (lambda _m: None)
    run = _Runner(slm, llm, tokenizer, fmt, params, say)
    dev = _split(tokenizer, dev_rows, fmt, params.n_examples, "dev")
    test = _split(tokenizer, test_rows, fmt, params.n_examples, "test")
    rule = params.rule

    # 1. dev references and every threshold method's τ from its own dev scores.
    llm_dev, slm_dev, dev_out = run.references(dev, "dev")
    scored: dict[str, Router] = dict(routers)
    scored["confidence"] = ConfidenceRouter.from_model(slm, vocab_size=run.vocab)
    if champion is not None:
        scored["champion"] = champion
    scores = method_scores(slm, scored, dev.prompts, slm_dev.tokens, params.batch_size, run.pad)
    thresholds = {m: taus_at_fractions(s, params.llm_fractions) for m, s in scores.items()}
    quantiles = {m: quantile_table(s) for m, s in scores.items()}
    notes: dict[str, Any] = {"dev_examples": len(dev.rows), "test_examples": len(test.rows)}

    query = None
    if train_rows:
        query, q_dev, q_test = _train_query(run, train_rows, dev, test, notes)
        thresholds["query"] = taus_at_fractions(q_dev, params.llm_fractions)
        quantiles["query"] = quantile_table(q_dev)

    # 2. dev passes; the rule picks each method's point.
    dev_out += _threshold_rows(run, dev, "dev", llm_dev, _points(scored, thresholds, params))
    if query is not None:
        dev_out += _query_rows(run, dev, q_dev, thresholds["query"], slm_dev, llm_dev, query.weight_bytes)
    methods = [*scored, "random"] + (["query"] if query is not None else [])
    chosen = {m: best_row(dev_out, rule, m, feasible_only=True) for m in methods}
    # The champion is compared at its best dev point even when none meets the rule (it then ranks below any
    # candidate that does).
    champ_dev = best_row(dev_out, rule, "champion", feasible_only=False) if champion is not None else None

    # 3. test: every point of every method, the oracle, speculative decoding, the champion at its dev τ.
    llm_test, slm_test, test_out = run.references(test, "test")
    at_test = dict(thresholds)
    if champ_dev is not None:
        at_test["champion"] = [(champ_dev.extra["target_llm_fraction"], champ_dev.tau)]
    test_out += _threshold_rows(run, test, "test", llm_test, _points(scored, at_test, params))
    if query is not None:
        test_out += _query_rows(
            run, test, q_test, thresholds["query"], slm_test, llm_test, query.weight_bytes
        )
    if params.oracle:
        test_out.append(_oracle_row(run, test, llm_test))
    if params.speculative:
        test_out.append(_speculative(run, test, llm_test))
    for m, row in chosen.items():
        if row is None:
            continue
        for t in test_out:
            if t.method == m and t.tau == row.tau:
                t.extra["selected_on_dev"] = True
    if champ_dev is not None:
        chosen["champion"] = champ_dev
        for t in test_out:
            if t.method == "champion":
                t.extra["selected_on_dev"] = True
    return SweepResult(dev_out, test_out, thresholds, quantiles, chosen, notes)


def _train_query(
    run: _Runner, train_rows: Sequence[Mapping[str, Any]], dev: _Split, test: _Split, notes: dict[str, Any]
) -> tuple[Any, Any, Any]:
    """The query router from SLM-alone outcomes on train questions; its scores on dev and test questions."""
    p = run.p
    train = _split(run.tok, train_rows, run.fmt, p.query.train_examples, "train")
    res, secs = run.run(train, "query labels (slm on train)", run.engine(AlwaysSLM(), 1.0, run.slm, None))
    feats = prompt_features(run.slm, train.prompts, p.batch_size, run.pad)
    router = train_query_router(feats, res.correct, p.query, p.seed)
    q_dev = router(prompt_features(run.slm, dev.prompts, p.batch_size, run.pad)).numpy()
    q_test = router(prompt_features(run.slm, test.prompts, p.batch_size, run.pad)).numpy()
    notes["query"] = {
        "train_examples": len(train.rows),
        "train_slm_accuracy": sum(res.correct) / len(res.correct),
    }
    return router, q_dev, q_test


def _oracle_row(run: _Runner, test: _Split, llm_res: PassResult) -> SweepRow:
    flags = oracle_flags(run.slm, test.prompts, llm_res.tokens, run.p.batch_size, run.pad, run.vocab)
    res, secs = run.run(test, "test oracle", run.engine(OracleRouter(flags), 0.5))
    agree = sum(a == b for a, b in zip(res.tokens, llm_res.tokens, strict=True)) / len(flags)
    return to_row(
        "oracle",
        None,
        res,
        llm_res,
        test.ex_hash,
        pass_seconds=secs,
        llm_agreement=agree,
        **oracle_summary(flags),
    )


def _speculative(run: _Runner, test: _Split, llm_res: PassResult) -> SweepRow:
    p = run.p
    n = len(test.rows)
    idx = list(range(min(p.speculative_examples or n, n)))
    t0 = time.perf_counter()
    outputs = speculative_generate(
        run.slm,
        run.llm,
        [test.prompts[i] for i in idx],
        max_new_tokens=p.max_new_tokens,
        draft_tokens=p.speculative_tokens,
        eos_token_id=run.eos,
        pad_token_id=run.pad,
        gpu=p.gpu,
        vocab_size=run.vocab,
    )
    sp, totals = speculative_result(
        outputs, run.tok, [test.rows[i] for i in idx], run.fmt, p.gpu, min(p.batch_size, n)
    )
    secs = time.perf_counter() - t0
    run.say(f"sweep test speculative: {len(idx)} questions, {secs:.1f}s")
    return speculative_row(sp, llm_res, idx, test.ex_hash, secs, totals)
