"""The evaluation sweep: every method chosen on dev, reported on test, through the same engine and cost model.

Protocol (nothing is tuned on test):
1. dev: LLM-only and SLM-only passes; each threshold method's scores at the decision positions of the SLM's own dev
   answers give its τ at every ``sweep.llm_fractions`` value (:mod:`citer.evaluation.thresholds`); the query router
   is trained on train questions and thresholded on dev questions (:mod:`citer.evaluation.query`).
2. dev: one pass per (method, τ) and per random fraction; the rule picks each method's operating point.
3. dev: verified routing (``citer_verify`` on the router variant the rule chose, ``bild``), its ρ and W chosen in
   stages (:mod:`citer.evaluation.verify_sweep`).
4. test: the same (method, τ) points, each verified method's curve at its dev-chosen ρ and W, plus the oracle bound
   (:mod:`citer.evaluation.oracle`) and speculative decoding on the whole split; the dev-chosen point of every method
   is marked ``selected_on_dev``. The re-evaluated champion runs on test only at the τ (and with the verification)
   its own dev pass chose.

Every byte figure is per question as if decoded alone (batch 1), router reads included; the batch-shared figures sit
in their own ``*_batch*`` columns. A pass is :mod:`citer.evaluation.passes`; the rule and promotion
:mod:`citer.evaluation.promotion`; frontiers, claims and intervals :mod:`citer.evaluation.pareto` and
:mod:`citer.evaluation.intervals`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from citer.config import SweepParams
from citer.config.serving import EngineParams
from citer.data.formats import Format
from citer.decoding.baselines import ConfidenceRouter, Router, router_read_bytes
from citer.decoding.cost import GPU_BANDWIDTH
from citer.evaluation.oracle import OracleRouter, oracle_flags, oracle_summary
from citer.evaluation.passes import PassResult, encode_prompts, examples_hash, speculative_row, to_row
from citer.evaluation.plan import (
    RANDOM,
    PassBench,
    PassMap,
    PassOutcome,
    PassSpec,
    Split,
    run_in_order,
)
from citer.evaluation.pricing import RouterShape
from citer.evaluation.promotion import VERIFY_KEYS, best_row, choose_candidate, point_key
from citer.evaluation.query import (
    combine_query,
    prompt_features,
    query_counts,
    query_decisions,
    scoring_bytes,
    train_query_router,
)
from citer.evaluation.sweep_rows import SweepError, SweepRow
from citer.evaluation.thresholds import method_scores, quantile_table, taus_at_fractions
from citer.evaluation.verify_sweep import VARIANTS, VerifyStages
from citer.evaluation.widths import as_method, pick_width, read_summary
from citer.routing.architecture import LAYERS_METHOD

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


def _split(tokenizer: Any, rows: Sequence[Mapping[str, Any]], fmt: Format, n: int, name: str) -> Split:
    use = list(rows[:n] if n > 0 else rows)
    if not use:
        raise SweepError(f"{name}: no examples to sweep")
    prompts = encode_prompts(tokenizer, use, fmt)
    return Split(use, prompts, examples_hash(prompts, use))


def _query_rows(
    bench: PassBench,
    split: Split,
    scores: Any,
    taus: Sequence[tuple[float, float]],
    slm_res: PassResult,
    llm_res: PassResult,
    weight_bytes: int,
) -> list[SweepRow]:
    extra = scoring_bytes(bench.slm, split.prompts, weight_bytes, bench.params.gpu)
    out = []
    for f, tau in taus:
        to_llm = query_decisions(scores, tau)
        charged = [e if m else 0.0 for e, m in zip(extra, to_llm, strict=True)]
        res = combine_query(slm_res, llm_res, to_llm, charged, GPU_BANDWIDTH[bench.params.gpu])
        counts = query_counts(slm_res, llm_res, to_llm, split.prompts)
        res.price(counts, RouterShape("query"), weight_bytes, *bench.pricings(), f"query τ={tau:g}")
        row = to_row("query", tau, res, llm_res, split.ex_hash, target_llm_fraction=f)
        row.extra["question_llm_fraction"] = sum(to_llm) / len(to_llm)
        out.append(row)
    return out


def _references(tag: str) -> list[PassSpec]:
    """The LLM-only and SLM-only passes of a split (rows ``llm`` and ``slm``)."""
    return [PassSpec(f"{tag} llm", tag, "llm", "llm"), PassSpec(f"{tag} slm", tag, "slm", "slm")]


def _points(
    tag: str,
    methods: Sequence[str],
    thresholds: Mapping[str, Sequence[tuple[float, float]]],
    params: SweepParams,
) -> list[PassSpec]:
    """Every threshold method at its (fraction, τ) points, then random routing at each fraction (its τ is p)."""
    pts = [
        PassSpec(f"{tag} {m} f={f:g}", tag, method=m, router=m, tau=tau, fraction=f)
        for m in methods
        for f, tau in thresholds[m]
    ]
    return pts + [
        PassSpec(f"{tag} random p={f:g}", tag, method="random", router=RANDOM, tau=0.5, fraction=f)
        for f in params.llm_fractions
    ]


def _point_row(spec: PassSpec, out: PassOutcome, llm_res: PassResult, split: Split) -> SweepRow:
    """A threshold pass's row. A pass decoded with verification (finite ``verify_rho``) also records its setting,
    the router it decoded with and the tokens its checks took back, so the setting is part of its point."""
    tau = spec.fraction if spec.router == RANDOM else spec.tau  # random routing's row τ is its probability
    extra: dict[str, Any] = {"pass_seconds": out.seconds, "target_llm_fraction": spec.fraction}
    if spec.engine.get("verify_rho", math.inf) < math.inf:
        extra |= {k: spec.engine[k] for k in VERIFY_KEYS} | {"router": spec.router}
        extra["rolled_back_tokens"] = int(sum(out.result.rolled_back))
    return to_row(spec.method, tau, out.result, llm_res, split.ex_hash, **extra)


def _ref_rows(outs: Sequence[PassOutcome], split: Split) -> list[SweepRow]:
    llm, slm = outs
    return [
        to_row("llm", None, llm.result, None, split.ex_hash, pass_seconds=llm.seconds),
        to_row("slm", None, slm.result, llm.result, split.ex_hash, pass_seconds=slm.seconds),
    ]


class _Passes:
    """Maps specs over the sweep's :data:`PassMap` and logs each pass in spec order."""

    def __init__(self, bench: PassBench, passes: PassMap, say: Log) -> None:
        self.bench, self.passes, self.say = bench, passes, say

    def __call__(self, specs: Sequence[PassSpec]) -> list[PassOutcome]:
        outs = self.passes(self.bench, list(specs))
        if len(outs) != len(specs):
            raise SweepError(f"pass map returned {len(outs)} outcomes for {len(specs)} passes")
        for s, o in zip(specs, outs, strict=True):
            r = o.result
            if s.kind == "speculative":
                self.say(f"sweep {s.name}: {o.n} questions, {o.seconds:.1f}s")
            else:
                self.say(f"sweep {s.name}: accuracy {sum(r.correct) / len(r.correct):.3f}, {o.seconds:.1f}s")
        return outs


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
    champion_verify: Mapping[str, Any] | None = None,
    log: Log | None = None,
    passes: PassMap = run_in_order,
    layer_routers: Mapping[str, Router] | None = None,
    engine: EngineParams | None = None,
) -> SweepResult:
    """Every method on dev (to choose) and test (to report). ``routers``: ``citer`` required, any of
    :data:`ROUTER_KEYS` optional. ``train_rows`` trains the query-level router (omitted: no query method).
    ``champion`` (the registered router holding the alias) is thresholded and chosen on dev like the candidate and
    re-evaluated on the same test examples, with ``champion_verify`` (its version's verification as RoutedEngine
    keyword arguments; None: plain). ``passes`` runs the decoding passes (:mod:`citer.evaluation.plan`; the
    flow maps them over ``runtime.task_runner``); the rows do not depend on it. ``layer_routers``
    (``citer@<tag>`` -> the CITER router at each ``router.layers_grid`` width, :mod:`citer.evaluation.widths`):
    each is decoded on dev, the rule picks one, and it is ``citer`` on test (``routers['citer']`` then goes
    unused). ``engine`` (the params' block): ``runner: llama_cpp`` decodes every routed and reference pass on
    llama.cpp (:class:`~citer.decoding.llama_cpp_engine.LlamaCppEngine`, verified routing included), and τ's
    quantiles and the oracle's flags come from its SLM's teacher-forced pass (the hidden states its router reads)."""
    if "citer" not in routers:
        raise SweepError("routers: key 'citer' missing (the trained router is required)")
    unknown = sorted(set(routers) - set(ROUTER_KEYS))
    if unknown:
        raise SweepError(f"routers: unknown keys {unknown}; expected some of {list(ROUTER_KEYS)}")
    grid = dict(layer_routers or {})
    if any(not k.startswith(LAYERS_METHOD) for k in grid):
        raise SweepError(f"layer_routers: keys {sorted(grid)} must start with {LAYERS_METHOD!r}")
    for r in [*routers.values(), *grid.values(), champion]:
        if isinstance(r, torch.nn.Module):
            r.eval()
    engine = engine or EngineParams()
    bench = PassBench(slm, llm, tokenizer, fmt, params, engine_params=engine)
    run = _Passes(bench, passes, log or (lambda _m: None))
    dev = bench.splits["dev"] = _split(tokenizer, dev_rows, fmt, params.n_examples, "dev")
    test = bench.splits["test"] = _split(tokenizer, test_rows, fmt, params.n_examples, "test")
    rule = params.rule

    # Passes run in three rounds, each as concurrent as its inputs allow: (1) the dev references (and the query
    # router's SLM pass on train); (2) every dev and test pass whose τ the dev scores fix, the test references and
    # speculative decoding; (3) the champion on test at its dev-chosen τ and the oracle (it reads the test LLM pass).
    first = _references("dev")
    if train_rows:
        bench.splits["train"] = _split(tokenizer, train_rows, fmt, params.query.train_examples, "train")
        first.append(PassSpec("query labels (slm on train)", "train", "slm", "slm"))
    outs = run(first)
    dev_out = _ref_rows(outs[:2], dev)
    llm_dev, slm_dev = outs[0].result, outs[1].result

    # Every threshold method's τ from its own dev scores.
    scored: dict[str, Router] = (
        {**grid, **{k: v for k, v in routers.items() if k != "citer"}} if grid else dict(routers)
    )
    scored["confidence"] = ConfidenceRouter.from_model(slm, vocab_size=bench.vocab)
    if champion is not None:
        scored["champion"] = champion
    bench.routers.update(scored)
    scoring = bench.scoring_engine()  # τ and the oracle from the SLM that decodes (torch's where None)
    scores = method_scores(slm, scored, dev.prompts, slm_dev.tokens, params.batch_size, bench.pad, scoring)
    thresholds = {m: taus_at_fractions(s, params.llm_fractions) for m, s in scores.items()}
    quantiles = {m: quantile_table(s) for m, s in scores.items()}
    notes: dict[str, Any] = {"dev_examples": len(dev.rows), "test_examples": len(test.rows)}

    query = None
    if train_rows:
        query, q_dev, q_test = _train_query(bench, outs[2].result, dev, test, notes)
        thresholds["query"] = taus_at_fractions(q_dev, params.llm_fractions)
        quantiles["query"] = quantile_table(q_dev)

    # 2. dev passes (the rule picks each method's point) and test passes (every point of every method but the
    # champion's, which waits for its dev choice).
    dev_pts = _with_engine(_points("dev", list(scored), thresholds, params), "champion", champion_verify)
    test_methods = [m for m in scored if m != "champion" and m not in grid]
    test_pts = _points("test", test_methods, thresholds, params)
    spec_pass = (
        [PassSpec("test speculative", "test", "speculative", "speculative")] if params.speculative else []
    )
    outs = run([*dev_pts, *_references("test"), *test_pts, *spec_pass])
    n_dev, n_test = len(dev_pts), len(test_pts)
    dev_outs, test_refs = outs[:n_dev], outs[n_dev : n_dev + 2]
    test_outs = {s.name: o for s, o in zip(test_pts, outs[n_dev + 2 : n_dev + 2 + n_test], strict=True)}
    spec_out = outs[n_dev + 2 + n_test :]

    dev_out += [_point_row(s, o, llm_dev, dev) for s, o in zip(dev_pts, dev_outs, strict=True)]
    if query is not None:
        dev_out += _query_rows(bench, dev, q_dev, thresholds["query"], slm_dev, llm_dev, query.weight_bytes)
    if grid:  # the width: chosen on dev like τ; the chosen router is citer from here on
        width = notes.setdefault("router_layers", pick_width(bench, dev_out, grid))["chosen"]
        dev_out += as_method(dev_out, width, "citer", router=width)
        scored = {"citer": grid[width], **scored}
        bench.routers["citer"] = grid[width]
        for table in (scores, thresholds, quantiles):
            table["citer"] = table[width]
    mine = {m: r for m, r in scored.items() if m in ROUTER_KEYS}
    notes["router_reads"] = read_summary(
        mine, {m: router_read_bytes(r, slm) for m, r in mine.items()}, *bench.pricings()
    )
    methods = [*scored, "random"] + (["query"] if query is not None else [])
    chosen = {m: best_row(dev_out, rule, m, feasible_only=True) for m in methods}
    stages = _verify_stages(params, dev_out, scored, scores, llm is not None)
    if stages is not None:
        # 3. dev: verified routing in stages (ρ x fraction, then windows at the best point).
        specs = stages.stage1()
        dev_out += [_point_row(s, o, llm_dev, dev) for s, o in zip(specs, run(specs), strict=True)]
        specs = stages.stage2(dev_out, rule)
        dev_out += [_point_row(s, o, llm_dev, dev) for s, o in zip(specs, run(specs), strict=True)]
        for m in stages.methods:
            chosen[m] = best_row(dev_out, rule, m, feasible_only=True)
        notes["verify"] = {"citer_verify_router": stages.routers.get("citer_verify")}
    # The champion is compared at its best dev point even when none meets the rule (it then ranks below any
    # candidate that does).
    champ_dev = best_row(dev_out, rule, "champion", feasible_only=False) if champion is not None else None

    # 3. test: every point of every method, the oracle, speculative decoding, the champion at its dev τ.
    test_out = _ref_rows(test_refs, test)
    llm_test, slm_test = test_refs[0].result, test_refs[1].result
    at_test = dict(thresholds)
    if champ_dev is not None:
        at_test["champion"] = [(champ_dev.extra["target_llm_fraction"], champ_dev.tau)]
    on_test = [m for m in scored if m not in grid]
    all_pts = _with_engine(_points("test", on_test, at_test, params), "champion", champion_verify)
    last = [s for s in all_pts if s.method == "champion" or (grid and s.method == "citer")]
    verified = []
    if stages is not None:  # each verified method's curve at its dev-chosen ρ and W (or its closest point)
        closest = {m: chosen[m] or best_row(dev_out, rule, m, feasible_only=False) for m in stages.methods}
        verified = stages.test_curve(closest)
        last += verified
    if params.oracle:
        flags = oracle_flags(
            slm, test.prompts, llm_test.tokens, params.batch_size, bench.pad, bench.vocab, scoring
        )
        bench.routers["oracle"] = OracleRouter(flags)
        last.append(PassSpec("test oracle", "test", method="oracle", router="oracle", tau=0.5))
    test_outs |= {s.name: o for s, o in zip(last, run(last), strict=True)}
    test_out += [_point_row(s, test_outs[s.name], llm_test, test) for s in all_pts]
    test_out += [_point_row(s, test_outs[s.name], llm_test, test) for s in verified]
    if query is not None:
        test_out += _query_rows(
            bench, test, q_test, thresholds["query"], slm_test, llm_test, query.weight_bytes
        )
    if params.oracle:
        test_out.append(_oracle_row(test_outs["test oracle"], test, llm_test, flags))
    if params.speculative:
        test_out.append(_speculative_row(spec_out[0], test, llm_test))
    for row in chosen.values():
        if row is None:
            continue
        for t in test_out:
            if point_key(t) == point_key(row):
                t.extra["selected_on_dev"] = True
    if champ_dev is not None:
        chosen["champion"] = champ_dev
        for t in test_out:
            if t.method == "champion":
                t.extra["selected_on_dev"] = True
    if grid:
        for t in test_out:
            if t.method == "citer":
                t.extra["router"] = notes["router_layers"]["chosen"]
    for r in [*dev_out, *test_out]:  # the priced columns say which pair they are priced at
        if r.bytes_priced is not None and params.price_at is not None:
            r.priced_at = params.price_at.name
    if scoring is not None:
        scoring.close()
        notes["teacher_forced_on"] = f"{engine.runner} {engine.llama_cpp_type}"
    return SweepResult(dev_out, test_out, thresholds, quantiles, chosen, notes)


def _with_engine(specs: list[PassSpec], method: str, engine: Mapping[str, Any] | None) -> list[PassSpec]:
    """``specs`` with ``method``'s passes decoding with ``engine`` (RoutedEngine keyword arguments)."""
    if not engine:
        return specs
    return [replace(s, engine=dict(engine)) if s.method == method else s for s in specs]


def _verify_stages(
    params: SweepParams,
    dev_rows: Sequence[SweepRow],
    scored: Mapping[str, Router],
    scores: Mapping[str, Any],
    have_llm: bool,
) -> VerifyStages | None:
    """The verified methods' grid, on the router variant the rule chose on dev (``citer`` when none meets it)."""
    v = params.verify
    if not v.enabled or not have_llm:
        return None
    variant = choose_candidate(dev_rows, params.rule, [m for m in VARIANTS if m in scored])
    # a citer row from the width grid names the router it decodes with
    routers = {
        "citer_verify": variant.extra.get("router", variant.method) if variant is not None else "citer"
    }
    if v.bild:
        routers["bild"] = "confidence"
    taus = {k: taus_at_fractions(scores[k], v.fractions) for k in set(routers.values())}
    return VerifyStages(v, routers, taus)


def _train_query(
    bench: PassBench, labels: PassResult, dev: Split, test: Split, notes: dict[str, Any]
) -> tuple[Any, Any, Any]:
    """The query router from SLM-alone outcomes (``labels``) on train questions; its scores on dev and test."""
    p = bench.params
    train = bench.splits["train"]
    feats = prompt_features(bench.slm, train.prompts, p.batch_size, bench.pad)
    router = train_query_router(feats, labels.correct, p.query, p.seed)
    q_dev = router(prompt_features(bench.slm, dev.prompts, p.batch_size, bench.pad)).numpy()
    q_test = router(prompt_features(bench.slm, test.prompts, p.batch_size, bench.pad)).numpy()
    notes["query"] = {
        "train_examples": len(train.rows),
        "train_slm_accuracy": sum(labels.correct) / len(labels.correct),
    }
    return router, q_dev, q_test


def _oracle_row(out: PassOutcome, test: Split, llm_res: PassResult, flags: Any) -> SweepRow:
    res = out.result
    agree = sum(a == b for a, b in zip(res.tokens, llm_res.tokens, strict=True)) / len(flags)
    return to_row(
        "oracle",
        None,
        res,
        llm_res,
        test.ex_hash,
        pass_seconds=out.seconds,
        llm_agreement=agree,
        **oracle_summary(flags),
    )


def _speculative_row(out: PassOutcome, test: Split, llm_res: PassResult) -> SweepRow:
    return speculative_row(out.result, llm_res, list(range(out.n)), test.ex_hash, out.seconds, out.totals)
