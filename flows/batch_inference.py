"""Stage ``batch_inference``: the champion router over a JSONL of questions; a rerun resumes where it stopped."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="batch-inference")
@locked("route")
def batch_inference_flow(
    params_path: str = "params.yaml",
    input: str | None = None,
    output: str | None = None,
    llm_fraction: float | None = None,
) -> dict[str, Any]:
    from citer.models.loading import load_tokenizer
    from citer.registry import verify_router_version
    from citer.serving.batch import route_file
    from citer.serving.champion import champion_tau, load_champion, project_champion

    proj = load_project(params_path)
    p = proj.params
    inf = p.inference
    rv = project_champion(proj)  # its own store, and a pair that matches params, or one line saying both
    # Fail closed even when the output is finished and nothing will be decoded: a tampered champion stops here.
    verify_router_version(rv)
    if llm_fraction is None and inf.tau is None:
        llm_fraction = inf.llm_fraction
    tau = champion_tau(rv, inf.tau if llm_fraction is None else None, llm_fraction)
    fmt = inf.format or p.data.format
    src = proj.path(input or inf.input or p.data.test)
    dst = proj.path(output or inf.output)

    def engine():
        return load_champion(proj, tau=tau).engine

    summary = route_file(
        engine,
        load_tokenizer(proj.model_ref(rv.tags["slm"])),
        src,
        dst,
        fmt,
        batch_size=inf.batch_size,
        max_new_tokens=inf.max_new_tokens,
        # the version's verification (rho, W, final) is part of what it writes: another one restarts the file
        meta={"router_version": rv.version, "tau": tau, "slm": rv.tags.get("slm", "")}
        | {k: v for k, v in rv.tags.items() if k.startswith("verify_")},
        restart_on_change=True,  # predictions for another input, champion or τ are never resumed
    )
    from citer.evaluation.html_report import write_report

    page = None
    if (proj.reports / "sweep.json").is_file() and (proj.reports / "promotion.json").is_file():
        page = write_report(proj.reports, dst, proj.reports / "report.html")  # the page to look at
    with stage_run(proj, "batch_inference") as run:
        run.params({"input": str(src), "output": str(dst), "router_version": rv.version, "tau": tau})
        run.metrics({k: v for k, v in summary.to_dict().items() if v is not None})
        if page is not None:
            run.artifact(page)
    out = summary.to_dict() | {"output": str(dst), "router_version": rv.version, "tau": tau}
    return out | ({"report": proj.portable_ref(page)} if page is not None else {})
