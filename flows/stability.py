"""``citer eval stability``: the sweep's claims across router seeds -> reports/stability.json.

Every router the sweep compares is retrained with ``stability.seeds - 1`` further seeds on the label sets it was
trained on (labels and models fixed), and each seed runs the whole sweep (:mod:`citer.evaluation.stability`); the
main run's seed is the sweep's own reports, which this reads, so run it after ``citer eval sweep``. Not a stage of
``citer pipeline`` or ``dvc.yaml``: it costs about one sweep and a set of routers per extra seed, more than the
pipeline's time budget allows (docs/results.md has the measured time).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from citer.project import load_project
from flows.common import locked, stage_run


@task(name="seed-routers", cache_policy=NO_CACHE)
def seed_routers(proj, slm, vocab_size: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep's routers retrained with ``seed``, each on the label set its own stage trained it on: the last
    iteration's (``citer``, the input ablations, every ``router.layers_grid`` width), iteration 1's (``citer_iter1``
    and, as one-step labels, ``citer_s``). Returns ``(routers, width routers)`` as the sweep takes them."""
    from citer.routing.architecture import LAYERS_METHOD, layers_tag
    from citer.routing.features import ABLATIONS
    from citer.routing.iterations import check_provenance, pair_digests
    from citer.routing.label_store import load_labels
    from citer.routing.labels import citer_s_labels
    from citer.routing.mlp import require_quality, train_router

    p = proj.params
    rp = p.router.model_copy(update={"seed": seed})
    pair = pair_digests(proj.slm_ref, proj.llm_ref)
    k = p.labels.iterations
    sets = {}
    for it in sorted({1, k}):
        sets[it] = load_labels(proj.labels_dir(it))
        check_provenance(
            sets[it].meta, pair, f"labels {proj.portable_ref(proj.labels_dir(it))}", ("slm", "llm")
        )

    def fit(labels, name: str, **update: Any) -> Any:
        router, metrics = train_router(labels, rp.model_copy(update=update), slm=slm, vocab_size=vocab_size)
        require_quality(metrics, rp.min_val_auc, f"router {name} (seed {seed})")
        return router

    routers = {"citer": fit(sets[k], "citer")}
    if k >= 2 and p.sweep.iter1:
        routers["citer_iter1"] = fit(sets[1], "citer_iter1")
    routers["citer_s"] = fit(citer_s_labels(sets[1]), "citer_s")
    for name in rp.ablations:
        routers[f"citer_{name}"] = fit(sets[k], f"citer_{name}", features=list(ABLATIONS[name]))
    grid = {}
    for layers in rp.layers_grid:
        method = LAYERS_METHOD + layers_tag(layers)
        own = [float(m) for m in layers] == [float(m) for m in rp.layers]
        grid[method] = routers["citer"] if own else fit(sets[k], method, layers=[float(m) for m in layers])
    return routers, grid


@flow(name="stability")
@locked("stability")
def stability_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.evaluation.report import claims_both, read_sweep
    from citer.evaluation.stability import ReusePasses, outcome, spread
    from citer.evaluation.sweep import run_sweep
    from citer.ops.io import file_digest, read_json, write_json
    from flows.runners import SweepPasses

    logger = get_run_logger()
    proj = load_project(params_path)
    p = proj.params
    rule = p.sweep.rule
    rep = proj.reports
    read = {f: rep / f for f in ("sweep_claims.json", "sweep_dev.json", "sweep_details.json")}
    missing = [str(f) for f in read.values() if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"stability reads the sweep's reports; run `citer eval sweep` first: missing {missing}"
        )
    main = p.router.seed
    outcomes = {
        main: outcome(
            read_json(read["sweep_claims.json"]),
            read_sweep(read["sweep_dev.json"]),
            read_sweep(read["sweep_details.json"]),
            rule,
        )  # fmt: skip
    }
    slm, llm, tok = proj.load_pair()
    splits = {s: proj.read_split(s) for s in ("dev", "test", "train")}
    passes = ReusePasses(SweepPasses(p.runtime))
    for seed in range(main + 1, main + p.stability.seeds):
        routers, grid = seed_routers(proj, slm, len(tok), seed)
        res = run_sweep(slm, llm, tok, splits["dev"], splits["test"], p.data.format, routers, p.sweep,
                        train_rows=splits["train"], log=logger.info, passes=passes, layer_routers=grid)  # fmt: skip
        outcomes[seed] = outcome(claims_both(res.test, p.sweep), res.dev, res.test, rule, res.notes)
        logger.info("seed %d: promoted %s", seed, outcomes[seed]["promoted"])
    report = spread(outcomes, main, rule) | {
        "read": {proj.portable_ref(f): file_digest(f) for f in read.values()},
        "passes_reused": passes.reused,
    }
    write_json(rep / "stability.json", report)
    with stage_run(proj, "stability") as run:
        run.params({"seeds": p.stability.seeds, "router.seed": main}, prefix="stability.")
        ratio = report["promoted"]["min_accuracy_ratio"]
        if ratio is not None:
            run.metrics({"promoted.min_accuracy_ratio": ratio})
        run.artifact(rep / "stability.json", "stability")
    return {"seeds": report["seeds"], "promoted": report["promoted"], "router_width": report["router_width"]}
