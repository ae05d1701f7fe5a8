"""Stage ``iterate`` (``citer router iterate``): labels and router for k = 1..labels.iterations, plus CITER-S and
the feature ablations (``router.ablations``: routers on the last iteration's labels at ``routers_dir/ablation_{name}``)
and the CITER router at each other width of ``router.layers_grid`` (``routers_dir/layers_{tag}``).

One stage owns every iteration because the count is a param (DVC cannot make stages from an int). Each label set and
router is kept when its recorded fingerprint matches its inputs (citer.routing.iterations), so a rerun caused by,
say, a router param only retrains the routers; iterations above labels.iterations and ablations no longer listed are
removed. The routers a label set is enough for train side by side on ``runtime.workers`` processes
(flows/train_router.py ``routers_flow``): iteration k's, with CITER-S on the first set and the ablations and widths
on the last.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from citer.project import load_project
from flows.common import locked


@flow(name="iterate")
@locked("iterate")
def iterate_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.routing.architecture import grid_widths
    from citer.routing.iterations import remove_stale_iterations
    from flows.collect_preferences import labels_flow
    from flows.train_router import routers_flow

    logger = get_run_logger()
    proj = load_project(params_path)
    p = proj.params
    n = p.labels.iterations
    out: dict[str, Any] = {}
    ablations = list(p.router.ablations)
    widths = grid_widths(p.router)
    for k in range(1, n + 1):
        out[f"labels_iter{k}"] = labels_flow(params_path, iteration=k, reuse=True)
        # The routers this label set is enough for, side by side: iteration k's (the next rollouts route with it),
        # CITER-S with the first, the ablation and width variants with the last.
        specs: list[dict[str, Any]] = [{"iteration": k}]
        if k == 1:
            specs.append({"citer_s": True})
        if k == n:
            specs += [{"ablation": name} for name in ablations]
            specs += [{"layers": layers} for layers in widths.values()]
        out.update(routers_flow(params_path, specs))
    removed = [
        *remove_stale_iterations(proj.path(p.paths.labels_dir), n),
        *remove_stale_iterations(proj.path(p.paths.routers_dir), n, ablations=ablations),
        *remove_stale_iterations(
            proj.reports, n, prefix="router_iter", ablations=ablations, ablation_prefix="router_ablation_"
        ),
        *remove_stale_iterations(
            proj.path(p.paths.routers_dir), n, ablations=widths, ablation_prefix="layers_"
        ),
        *remove_stale_iterations(
            proj.reports, n, "router_iter", ablations=widths, ablation_prefix="router_layers_"
        ),
    ]
    for key, res in out.items():
        logger.info("%s: %s", key, "unchanged, kept" if res.get("reused") else "made")
    out["removed"] = [str(r) for r in removed]
    return out
