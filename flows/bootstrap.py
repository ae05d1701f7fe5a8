"""Stage ``bootstrap_models`` (embedded default only): tokenizer + SLM base + LLM trained from scratch."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import stage_run


@flow(name="bootstrap-models")
def bootstrap_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.io import write_json
    from citer.models.bootstrap import bootstrap_models

    proj = load_project(params_path)
    p = proj.params
    if not p.bootstrap.enabled:
        return {"skipped": True}
    metrics = bootstrap_models(p.bootstrap, proj.path(p.paths.data_dir), proj.path(p.paths.models_dir))
    write_json(proj.path(p.paths.reports_dir) / "bootstrap.json", metrics)
    with stage_run(proj, "bootstrap_models") as run:
        run.params(p.bootstrap.model_dump(), prefix="bootstrap.")
        run.metrics({k: v for k, v in metrics.items() if not isinstance(v, dict)})
    return metrics
