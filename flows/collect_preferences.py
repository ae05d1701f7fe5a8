"""Stages ``labels_iter{k}``: token-level preference labels (k = 1: ground-truth shortcut; k >= 2: routed rollouts)."""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from citer.project import load_project
from flows.common import stage_run


@task(name="collect-labels", task_run_name="collect labels, iteration {iteration}")
def collect(proj, iteration: int):
    from citer.routing.label_store import load_labels
    from citer.routing.labels import collect_iter1, collect_iter_k
    from citer.routing.mlp import load_router

    p = proj.params
    slm, llm, tok = proj.load_pair()
    rows = proj.read_split("train")
    hidden = slm.config.hidden_size
    if iteration == 1:
        return collect_iter1(
            slm, llm, tok, rows, p.data.format, p.labels, slm_name=proj.slm_name, llm_name=p.models.llm
        ), hidden
    prev = load_labels(proj.labels_dir(iteration - 1), expected_hidden_size=hidden)
    router, _ = load_router(
        proj.router_dir(iteration - 1), expected_hidden_size=hidden, expected_slm=proj.slm_name
    )
    return collect_iter_k(prev, router, slm, llm, tok, rows, p.data.format, p.labels), hidden


@flow(name="collect-preferences")
def labels_flow(params_path: str = "params.yaml", iteration: int = 1) -> dict[str, Any]:
    from citer.routing.label_store import save_labels, validate_labels

    proj = load_project(params_path)
    if not 1 <= iteration <= proj.params.labels.iterations:
        raise ValueError(
            f"labels.iterations is {proj.params.labels.iterations}; iteration {iteration} is out of range"
        )
    labelset, hidden = collect(proj, iteration)
    report = validate_labels(labelset, hidden)
    out = save_labels(labelset, proj.labels_dir(iteration))
    counts = labelset.case_counts()
    with stage_run(proj, f"labels_iter{iteration}") as run:
        run.params(proj.params.labels.model_dump(), prefix="labels.")
        run.metrics({f"case.{k}": v for k, v in counts.items()} | {"n_tokens": labelset.n_tokens})
        run.metrics(
            {
                k: v
                for k, v in labelset.meta.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
        )
        run.metrics({f"labels.{k}": v for k, v in report.get("label_counts", {}).items()})
    return {"dir": str(out), "n_tokens": labelset.n_tokens, "case_counts": counts, "meta": labelset.meta}
