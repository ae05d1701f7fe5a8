"""Stage ``bootstrap_models`` (embedded default only): tokenizer + SLM base + LLM trained from scratch."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import load_context, stage_run


@flow(name="bootstrap-models")
def bootstrap_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.bootstrap import bootstrap_models
    from citer.io import write_json

    ctx = load_context(params_path)
    p = ctx.params
    if not p.bootstrap.enabled:
        return {"skipped": True}
    metrics = bootstrap_models(p.bootstrap, ctx.path(p.paths.data_dir), ctx.path(p.paths.models_dir))
    write_json(ctx.path(p.paths.reports_dir) / "bootstrap.json", metrics)
    with stage_run(ctx, "bootstrap_models") as run:
        run.params(p.bootstrap.model_dump(), prefix="bootstrap.")
        run.metrics({k: v for k, v in metrics.items() if not isinstance(v, dict)})
    return metrics
