"""Stages ``router_iter{k}`` and ``router_citer_s``: train the MLP router on a label set, keep the best epoch."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import stage_run


@flow(name="train-router")
def router_flow(
    params_path: str = "params.yaml", iteration: int = 1, citer_s: bool = False
) -> dict[str, Any]:
    from citer.io import read_json, write_json
    from citer.routing.label_store import load_labels
    from citer.routing.labels import citer_s_labels
    from citer.routing.mlp import (
        iteration_summary,
        router_meta,
        save_router,
        train_router,
        write_router_report,
    )

    proj = load_project(params_path)
    p = proj.params
    labelset = load_labels(proj.labels_dir(1 if citer_s else iteration))
    if citer_s:
        labelset = citer_s_labels(labelset)
    router, metrics = train_router(labelset, p.router)
    name: int | str = "citer_s" if citer_s else iteration
    out = save_router(
        router, proj.router_dir(name), router_meta(labelset, metrics, slm=proj.slm_name, llm=p.models.llm)
    )
    summary = iteration_summary(labelset, metrics)
    write_json(proj.reports / f"router_{'citer_s' if citer_s else f'iter{iteration}'}.json", summary)
    if not citer_s and iteration == p.labels.iterations:
        done = [read_json(proj.reports / f"router_iter{k}.json") for k in range(1, iteration + 1)]
        write_router_report(proj.reports / "router.json", done)
    with stage_run(proj, f"router_{name if citer_s else f'iter{iteration}'}") as run:
        run.params(p.router.model_dump(), prefix="router.")
        run.metrics(metrics.scalars())
        for epoch, row in enumerate(metrics.curves):
            run.metrics({f"epoch.{k}": v for k, v in row.items() if k != "epoch"}, step=epoch)
        run.artifact(out, "router")
    return {"dir": str(out), **summary}
