"""Stage ``validate``: check every configured dataset file against its Great Expectations suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task

from citer.project import load_project
from flows.common import stage_run


@task(name="validate-file", task_run_name="validate {path}")
def validate_one(path: str, fmt: str, max_chars_warning: int) -> dict[str, Any]:
    from citer.data.validate import validate_file

    report = validate_file(path, fmt, max_chars_warning=max_chars_warning)
    return report.to_dict() | {"summary": report.summary()}


@flow(name="validate", log_prints=False)
def validate_flow(
    params_path: str = "params.yaml",
    files: list[tuple[str, str]] | None = None,
    report_path: str | None = None,
) -> list[dict[str, Any]]:
    """Validate ``files`` (default: the configured splits); write one JSON report and log it to MLflow."""
    from citer.io import write_json

    proj = load_project(params_path, optional=files is not None)
    targets = files or proj.validation_files()
    reports = [validate_one(path, fmt, proj.params.validate_.max_chars_warning) for path, fmt in targets]
    out = Path(report_path) if report_path else proj.path(proj.params.paths.reports_dir) / "validation.json"
    write_json(out, {"files": [{k: v for k, v in r.items() if k != "summary"} for r in reports]})
    with stage_run(proj, "validate") as run:
        run.params({"files": [f"{p}:{fmt}" for p, fmt in targets]})
        run.metrics(
            {
                "n_files": len(reports),
                "n_rows": sum(r["n_rows"] for r in reports),
                "n_errors": sum(r["n_errors"] for r in reports),
                "n_warnings": sum(r["n_warnings"] for r in reports),
            }
        )
        run.artifact(out)
    return reports
