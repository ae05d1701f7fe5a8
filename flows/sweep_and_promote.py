"""Stage ``sweep``: τ sweep against every baseline, choice of τ, registration, guarded promotion to the alias."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from citer.project import load_project
from flows.common import locked, stage_run

PENDING_FILE = ".state/promotion_pending.json"  # the intent of a registration + alias move in progress


@task(name="find-champion", retries=2, retry_delay_seconds=2)
def find_champion(proj, slm, pair):
    from citer.tracking.registry import champion_to_compare
    from citer.tracking.store import open_store

    reg = proj.params.registry
    return champion_to_compare(
        reg.model_name,
        reg.alias,
        slm=proj.portable_ref(proj.slm_name),
        hidden_size=slm.config.hidden_size,
        tracking_uri=open_store(proj),
        root=proj.root,
        slm_model=slm,
        pair=pair,
    )


@task(name="sweep-routers", cache_policy=NO_CACHE)
def sweep_routers(proj, slm, vocab_size: int, pair) -> tuple[dict[str, Any], dict[str, Any]]:
    """The routers the sweep compares: the last iteration's (``citer``, with its meta), iteration 1's, CITER-S and
    the router-input ablations, each when present on disk. Every one must have been trained for the pair in use
    (``pair``, its digests): a router left by an interrupted ``iterate`` for the previous SLM is refused, never
    swept (``citer router iterate`` retrains it)."""
    from citer.routing.mlp import META_FILE, load_router
    from citer.routing.pair_check import check_pair

    p = proj.params
    hidden = slm.config.hidden_size
    k = p.labels.iterations
    dirs = {"citer": proj.router_dir(k)}
    dirs["citer_iter1"] = proj.method_router_dir("citer_iter1") if k >= 2 and p.sweep.iter1 else None
    dirs["citer_s"] = proj.method_router_dir("citer_s")
    for name in p.router.ablations:
        dirs[f"citer_{name}"] = proj.method_router_dir(f"citer_{name}")
    routers: dict[str, Any] = {}
    metas: dict[str, dict[str, Any]] = {}
    for method, d in dirs.items():
        if d is None or (method != "citer" and not (d / META_FILE).exists()):
            continue
        routers[method], metas[method] = load_router(
            d, expected_hidden_size=hidden, expected_slm=proj.slm_name, slm=slm, vocab_size=vocab_size
        )
        # A router reads one SLM's hidden states: refuse one trained for other weights under the same name.
        check_pair(
            metas[method],
            pair,
            f"router {proj.portable_ref(d)} ({method})",
            remedy="run `citer router iterate` (it retrains routers made for another pair), then the sweep",
        )
    return routers, metas["citer"]


@task(name="width-routers", cache_policy=NO_CACHE)
def width_routers(proj, slm, vocab_size: int, citer: Any, pair) -> dict[str, Any]:
    """The CITER router at each ``router.layers_grid`` width (``citer@<tag>``): ``router.layers``' own is the last
    iteration's router (``citer``), the others their own directories. Empty without a grid."""
    from citer.routing.architecture import LAYERS_METHOD, layers_tag
    from citer.routing.mlp import load_router
    from citer.routing.pair_check import check_pair

    rp = proj.params.router
    out: dict[str, Any] = {}
    for layers in rp.layers_grid:
        method = LAYERS_METHOD + layers_tag(layers)
        if [float(m) for m in layers] == [float(m) for m in rp.layers]:
            out[method] = citer
            continue
        d = proj.method_router_dir(method)
        router, meta = load_router(
            d,
            expected_hidden_size=slm.config.hidden_size,
            expected_slm=proj.slm_name,
            slm=slm,
            vocab_size=vocab_size,
        )
        check_pair(
            meta,
            pair,
            f"router {proj.portable_ref(d)} ({method})",
            remedy="run `citer router iterate` (it retrains routers made for another pair), then the sweep",
        )
        out[method] = router
    return out


@flow(name="sweep-decode")
def sweep_decode(params_path: str = "params.yaml") -> tuple[Any, Any, dict[str, Any], int]:
    """Every decoding pass of the sweep, mapped over the flow's task runner (``runtime``); returns the sweep's
    result, the champion compared, the candidate router's meta and the SLM's hidden size."""
    from citer.evaluation.sweep import run_sweep
    from flows.runners import SweepPasses

    logger = get_run_logger()
    proj = load_project(params_path)
    p = proj.params
    from citer.routing.iterations import pair_digests

    pair = pair_digests(proj.slm_ref, proj.llm_ref)
    slm, llm, tok = proj.load_pair()
    routers, rmeta = sweep_routers(proj, slm, len(tok), pair)
    champion = find_champion(proj, slm, pair)
    logger.info(champion.note)
    with SweepPasses.local_processes(p.runtime, slm, llm) as passes:
        result = run_sweep(
            slm,
            llm,
            tok,
            proj.read_split("dev"),
            proj.read_split("test"),
            p.data.format,
            routers,
            p.sweep,
            train_rows=proj.read_split("train"),
            champion=champion.router,
            # the champion decodes as registered: with its version's verification, if it has one
            champion_verify=champion.version.verify_kwargs if champion.version and champion.router else None,
            log=logger.info,
            passes=passes,
            layer_routers=width_routers(proj, slm, len(tok), routers["citer"], pair),
            engine=p.engine,
        )
    return result, champion, rmeta, int(slm.config.hidden_size)


@flow(name="sweep-and-promote")
@locked("sweep")
def sweep_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.evaluation.promotion import Guard, plan_promotion, promotion_record, version_tags
    from citer.evaluation.report import sweep_measured, sweep_metrics, write_sweep_reports
    from citer.ops.io import file_digest, write_json
    from citer.tracking.alias import AliasMoved, finish_pending
    from citer.tracking.provenance import git_head, record_run_facts
    from citer.tracking.registry import generator_config, publish_router
    from citer.tracking.store import open_store
    from flows.runners import TaskRunners

    logger = get_run_logger()
    proj = load_project(params_path)
    p = proj.params
    pending = proj.root / PENDING_FILE
    recovered = finish_pending(pending, proj.reports / "promotion.json", open_store(proj))
    if recovered:
        logger.warning("interrupted promotion: %s", recovered)
    runner = TaskRunners.build(p.runtime)
    result, champion, rmeta, hidden = sweep_decode.with_options(task_runner=runner)(params_path)
    k = p.labels.iterations
    found = write_sweep_reports(proj.reports, result, p.sweep)
    guard = Guard(
        min_examples=p.registry.min_eval_examples,
        resamples=p.sweep.intervals.resamples,
        seed=p.sweep.seed,
        level=p.sweep.intervals.level,
    )
    plan = plan_promotion(
        result.dev,
        result.test,
        p.sweep.rule,
        champion.version.version if champion.version else None,
        champion.note,
        guard=guard,
        champion_stale=champion.stale,
    )

    reg = p.registry
    version = None
    with stage_run(proj, "sweep") as run:
        run.params(p.sweep.model_dump(), prefix="sweep.")
        run.metrics(sweep_metrics(result.test, found))
        for f in ("sweep.json", "sweep_details.json", "sweep_dev.json", "sweep_claims.json", "pareto.png"):
            run.artifact(proj.reports / f, "sweep")
        if plan.best is not None:
            # the router the chosen point decodes with (a verified point names it in extra.router)
            chosen_router = str(plan.best.extra.get("router", plan.best.method))
            router_dir = proj.method_router_dir(chosen_router)
            tags = version_tags(
                plan.best,
                p.sweep.rule,
                slm=proj.portable_ref(proj.slm_name),  # relative to the root: a copied project names its own
                llm=proj.portable_ref(p.models.llm),
                hidden_size=hidden,
                iteration=k,
                labels_hash=rmeta.get("data_hash", ""),
                data_version=file_digest(proj.path(p.data.train), "md5"),  # as DVC records it
                git_commit=git_head(proj.root),
                runner=p.engine.runner_name(),
                files={
                    "router_dir": proj.portable_ref(router_dir),
                    "data_train": proj.portable_ref(p.data.train),
                    "data_test": proj.portable_ref(p.data.test),
                },
            ) | {"router_inputs": ",".join(proj.router_inputs(router_dir))}
            expected = champion.version.version if champion.version else None
            intent = {"model": reg.model_name, "alias": reg.alias, "run_id": run.run_id, "expected": expected}
            intent |= {"promote": plan.decision.promoted, "record": promotion_record(plan, None, result.test)}
            write_json(pending, intent)  # a kill from here on is completed or retired by the next sweep
            try:
                version = publish_router(
                    router_dir,
                    model_name=reg.model_name,
                    alias=reg.alias,
                    run_id=run.run_id,
                    tags=tags,
                    promote=plan.decision.promoted,
                    tracking_uri=proj.tracking_uri,
                    model_config=generator_config(proj, plan.best.tau, tags),
                    expected_champion=expected,
                    quantiles=result.quantiles[chosen_router],  # a file beside the router
                ).version
            except AliasMoved as exc:
                version = exc.version
                plan = replace(plan, decision=replace(plan.decision, promoted=False, reason=str(exc)))
        run.tags({"promotion.promoted": plan.decision.promoted, "promotion.reason": plan.decision.reason})
    decision = plan.decision
    logger.info("promotion: %s (%s)", "promoted" if decision.promoted else "kept", decision.reason)
    promotion = promotion_record(plan, version, result.test)
    write_json(proj.reports / "promotion.json", promotion)
    record_run_facts(proj.reports, "sweep", {"mlflow_run_id": run.run_id, "rows": sweep_measured(result)})
    pending.unlink(missing_ok=True)
    return promotion | {"claims": {k: v for k, v in found.items() if k != "protocol"}}
