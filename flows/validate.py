"""Stage ``validate``: check every configured dataset file against its Great Expectations suite.

Rows whose prompt + reference exceed the models' context are found here too, all at once, when the models are
known: named with ``--model`` (``citer data validate --model DIR``), or the params' pair when ``bootstrap`` is off
(with bootstrap on the models do not exist yet at this stage, and the report says the check was skipped).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from citer.project import load_project
from flows.common import record_reports, stage_run


@task(name="context-budget", cache_policy=NO_CACHE)
def context_budget(proj, models: list[str] | None) -> tuple[Any, str | None]:
    """``(budget, None)`` for the models rows are measured against, or ``(None, why the check is skipped)``."""
    from citer.data.lengths import load_budget

    trust = proj.params.models.trust_remote_code
    if models:  # named by the user: a model that cannot be read is an error
        return load_budget(models, trust), None
    m = proj.params.models
    if proj.params.bootstrap.enabled:
        return None, "bootstrap.enabled is true: the models are built after validation (pass --model DIR)"
    refs = [proj.model_ref(m.slm), proj.model_ref(m.llm)]
    try:
        return load_budget(refs, trust), None
    except ValueError as exc:
        return None, f"models.slm/models.llm not readable yet: {str(exc).splitlines()[0]}"


@task(name="validate-file", task_run_name="validate {path}", cache_policy=NO_CACHE)
def validate_one(
    path: str, fmt: str, max_chars_warning: int, max_bad_row_fraction: float, budget: Any, skipped: str | None
) -> dict[str, Any]:
    from citer.data.validate import validate_file

    report = validate_file(
        path,
        fmt,
        max_chars_warning=max_chars_warning,
        max_bad_row_fraction=max_bad_row_fraction,
        budget=budget,
    )
    if skipped is not None:
        report.context = {"skipped": skipped}
    return report.to_dict() | {"summary": report.summary()}


@flow(name="validate", log_prints=False)
def validate_flow(
    params_path: str = "params.yaml",
    files: list[tuple[str, str]] | None = None,
    report_path: str | None = None,
    models: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Validate ``files`` (default: the configured splits); write one JSON report and log it to MLflow.

    ``models`` (directories or hub ids) set the context the rows must fit; default: see the module docstring.
    """
    import mlflow  # noqa: F401 - for the run below, loaded while Great Expectations loads (citer.data.validate)

    from citer.ops.io import write_json

    started = time.time()
    proj = load_project(params_path, optional=files is not None)
    targets = files or proj.validation_files()
    vp = proj.params.validate_
    budget, skipped = context_budget(proj, models)
    reports = [
        validate_one(path, fmt, vp.max_chars_warning, vp.max_bad_row_fraction, budget, skipped)
        for path, fmt in targets
    ]
    out = Path(report_path) if report_path else proj.path(proj.params.paths.reports_dir) / "validation.json"
    # The project records its files relative to its root (a copied project stays self-contained).
    for r in reports:
        r["path"] = proj.portable_ref(r["path"])
    write_json(out, {"files": [{k: v for k, v in r.items() if k != "summary"} for r in reports]})
    with stage_run(proj, "validate") as run:
        run.params({"files": [f"{r['path']}:{fmt}" for r, (_, fmt) in zip(reports, targets, strict=True)]})
        if budget is not None:
            run.params({"context_limit": budget.limit, "context_source": budget.source})
        run.metrics(
            {
                "n_files": len(reports),
                "n_rows": sum(r["n_rows"] for r in reports),
                "n_errors": sum(r["n_errors"] for r in reports),
                "n_warnings": sum(r["n_warnings"] for r in reports),
                "n_rows_over_context": sum((r["context"] or {}).get("n_over", 0) for r in reports),
            }
        )
        run.artifact(out)
    # a report of the project, not a file a user named
    if out.resolve().is_relative_to(proj.reports.resolve()):
        record_reports(proj, "validate", started)
    return reports
