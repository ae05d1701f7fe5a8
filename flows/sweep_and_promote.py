"""Stage ``sweep``: τ sweep against every baseline, choice of τ, registration, guarded promotion to the alias."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from flows.common import git_commit, load_context, stage_run, tracking_uri


@task(name="load-champion", retries=2, retry_delay_seconds=2)
def load_champion(ctx, hidden_size: int) -> tuple[Any, Any, str]:
    """``(version, (router, tau) | None, note)``: the current champion, re-usable here only with the same SLM."""
    from citer.registry import get_alias, load_router_version

    reg = ctx.params.registry
    rv = get_alias(reg.model_name, reg.alias, tracking_uri(ctx))
    if rv is None:
        return None, None, "no champion yet"
    if rv.tags.get("slm") != ctx.slm_ref:
        return rv, None, f"champion v{rv.version} routes for SLM {rv.tags.get('slm')}, not {ctx.slm_ref}"
    router = load_router_version(rv)
    if router.hidden_size != hidden_size:
        return rv, None, f"champion v{rv.version} has hidden_size {router.hidden_size}, the SLM {hidden_size}"
    return rv, (router, rv.tau), f"champion v{rv.version} re-evaluated at tau={rv.tau}"


@flow(name="sweep-and-promote")
def sweep_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.io import file_digest, write_json
    from citer.registry import Decision, register_router, set_alias
    from citer.router import load_router
    from citer.sweep import (
        choose_tau,
        claims,
        decide_promotion,
        plot_pareto,
        run_sweep,
        write_pareto_json,
        write_plot_data,
        write_sweep,
    )

    logger = get_run_logger()
    ctx = load_context(params_path)
    p = ctx.params
    slm, llm, tok = ctx.load_pair()
    hidden = slm.config.hidden_size
    k = p.labels.iterations
    router_dir = ctx.router_dir(k)
    router, rmeta = load_router(router_dir, expected_hidden_size=hidden, expected_slm=ctx.slm_name)
    routers = {"citer": router}
    if (ctx.router_dir("citer_s") / "router.json").exists():
        routers["citer_s"] = load_router(ctx.router_dir("citer_s"), expected_hidden_size=hidden)[0]
    rows = ctx.read_split("test")
    if p.sweep.n_examples:
        rows = rows[: p.sweep.n_examples]
    champ_rv, champion, champ_note = load_champion(ctx, hidden)
    logger.info(champ_note)

    sweep = run_sweep(
        slm, llm, tok, rows, p.data.format, routers, p.sweep, champion=champion, log=logger.info
    )
    rep = ctx.reports
    write_sweep(rep / "sweep.json", sweep, rep / "sweep_details.json")
    write_pareto_json(rep / "pareto.json", sweep)
    write_plot_data(rep / "pareto", sweep)
    plot_pareto(sweep, rep / "pareto.png")
    found = claims(sweep, p.sweep.rule.accuracy_ratio)
    write_json(rep / "sweep_claims.json", found)

    best = choose_tau(sweep, p.sweep.rule)
    champion_row = next((r for r in sweep if r.method == "champion"), None)
    if champ_rv is not None and champion_row is None:
        decision = Decision(False, f"kept v{champ_rv.version}: {champ_note}; it cannot be compared here")
    else:
        decision = decide_promotion(
            best, champion_row, p.sweep.rule, previous=champ_rv.version if champ_rv else None
        )

    reg = p.registry
    version = None
    with stage_run(ctx, "sweep") as run:
        run.params(p.sweep.model_dump(), prefix="sweep.")
        for r in sweep:
            tag = r.method if r.tau is None else f"{r.method}.tau_{r.tau:g}"
            run.metrics({f"{tag}.accuracy": r.accuracy, f"{tag}.bytes_rel_llm": r.bytes_moved_rel_llm})
        run.metrics({f"claims.{k_}": v for k_, v in found.items() if isinstance(v, (int, float))})
        for f in ("sweep.json", "sweep_details.json", "sweep_claims.json", "pareto.png"):
            run.artifact(rep / f, "sweep")
        if best is not None:
            tags = {
                "slm": ctx.slm_ref,
                "llm": ctx.llm_ref,
                "tau": best.tau,
                "hidden_size": hidden,
                "iteration": k,
                "labels_hash": rmeta.get("data_hash", ""),
                "data_version": file_digest(ctx.path(p.data.train), "md5"),  # as DVC records it
                "eval_examples_hash": best.examples_hash,
                "git_commit": git_commit(ctx.root),
                "rule": p.sweep.rule.model_dump_json(),
                "accuracy": best.accuracy,
                "bytes_moved_rel_llm": best.bytes_moved_rel_llm,
                "llm_token_fraction": best.llm_token_fraction,
                "sec_per_token": best.sec_per_token,
            }
            rv = register_router(
                router_dir,
                model_name=reg.model_name,
                run_id=run.run_id,
                tags=tags,
                tracking_uri=tracking_uri(ctx),
            )
            version = rv.version
            if decision.promoted:
                set_alias(reg.model_name, reg.alias, rv.version, tracking_uri(ctx))
        run.tags({"promotion.promoted": decision.promoted, "promotion.reason": decision.reason})
    logger.info("promotion: %s (%s)", "promoted" if decision.promoted else "kept", decision.reason)
    promotion = {
        "promoted": int(decision.promoted),
        "reason": decision.reason,
        "version": version,
        "previous": decision.previous,
        "tau": best.tau if best else None,
        "accuracy": best.accuracy if best else None,
        "bytes_moved_rel_llm": best.bytes_moved_rel_llm if best else None,
        "llm_accuracy": next((r.accuracy for r in sweep if r.method == "llm"), None),
    }
    write_json(rep / "promotion.json", promotion)
    return promotion | {"claims": found}
