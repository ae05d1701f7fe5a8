"""Stage ``batch_inference``: the champion router over a JSONL of questions; a rerun resumes where it stopped.

Two kinds of run. The pipeline's own (``citer route`` with no ``--input``/``--output``, what ``dvc repro`` and
``citer pipeline`` run): routes ``inference.input`` (else ``data.test``) into ``inference.output``, writes
``reports/report.html``, logs an MLflow run and stamps ``reports/provenance.json``. When the sweep promoted nothing
it still ends well: it writes an empty predictions file whose sidecar says ``no champion: <reason>``, so a first run
that promoted nothing is an outcome, not a failure. A side run (``--input``/``--output`` given) writes only its
output, the output's ``.meta.json`` and its own ``.summary.json`` beside it: the project's reports, provenance and
MLflow runs are left alone, and without a champion it fails.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="batch-inference")
@locked("route", side_run=lambda a: a.get("input") is not None or a.get("output") is not None)
def batch_inference_flow(
    params_path: str = "params.yaml",
    input: str | None = None,
    output: str | None = None,
    llm_fraction: float | None = None,
    allow_pair_mismatch: bool = False,
) -> dict[str, Any]:
    from citer.evaluation.html_report import write_report
    from citer.models.loading import load_tokenizer
    from citer.ops.io import write_json
    from citer.serving.batch import route_file, write_without_champion
    from citer.serving.champion import build_champion
    from citer.tracking.deployed import open_champion
    from citer.tracking.registry import NoChampion

    proj = load_project(params_path)
    p = proj.params
    inf = p.inference
    side = input is not None or output is not None  # a side run records nothing of the project's
    if input is not None and output is None:
        raise ValueError(
            "--input routes a file of your own: give --output too (inference.output holds the pipeline's run)"
        )
    fmt = inf.format or p.data.format
    src = proj.path(input or inf.input or p.data.test)
    dst = proj.path(output or inf.output)
    outside = None
    if p.bootstrap.enabled:  # the embedded pair knows its own task only: say when questions leave it
        from citer.data.task_vocab import questions_outside_task

        outside = questions_outside_task(src, fmt, max(p.synth.max_total, p.synth.max_start))
        if outside[0]:
            print(
                f"warning: {outside[0]} of {outside[1]} questions use words or numbers the embedded task never has "
                f"({', '.join(outside[2])}); the embedded pair answers only its own task (README: The embedded "
                "default)",
                file=sys.stderr,
            )
    status = None  # one lookup: the champion (its pair matched to params, its files verified) and τ, or none
    try:
        with open_champion(
            proj, llm_fraction=llm_fraction, settings=inf, allow_pair_mismatch=allow_pair_mismatch
        ) as dep:
            rv, tau = dep.version, dep.tau
            summary = route_file(  # a finished output decodes nothing: the engine is built only when needed
                lambda: build_champion(proj, dep).engine,
                load_tokenizer(proj.model_ref(rv.tags["slm"])),
                src,
                dst,
                fmt,
                batch_size=inf.batch_size,
                max_new_tokens=inf.max_new_tokens,
                # the version's verification (rho, W, final) is part of what it writes: another one restarts it
                meta={"router_version": rv.version, "tau": tau, "slm": rv.tags.get("slm", "")}
                | {k: v for k, v in rv.tags.items() if k.startswith("verify_")},
                restart_on_change=True,  # predictions for another input, champion or τ are never resumed
            )
        out = summary.to_dict() | {"output": str(dst), "router_version": rv.version, "tau": tau}
        out |= {"outside_task": outside[0]} if outside is not None else {}
    except NoChampion as exc:  # the pipeline's own run ends well: an empty predictions file says why
        if side:
            raise
        status = f"no champion: {exc.reason}"
        write_without_champion(src, dst, fmt, status)
        out = {"status": status, "n": 0, "output": proj.portable_ref(dst)}
    if side:  # its own summary beside its output; nothing of the project's is touched
        write_json(dst.with_name(dst.name + ".summary.json"), out | {"input": str(src)})
        return out
    page = None
    if (proj.reports / "sweep.json").is_file() and (proj.reports / "promotion.json").is_file():
        page = write_report(proj.reports, dst, proj.reports / "report.html")  # the page to look at
    with stage_run(proj, "batch_inference") as run:
        if status is None:
            run.params({"input": str(src), "output": str(dst), "router_version": rv.version, "tau": tau})
            run.metrics({k: v for k, v in summary.to_dict().items() if v is not None})
        else:
            run.params({"input": proj.portable_ref(src), "output": proj.portable_ref(dst)})
            run.tags({"status": status})
        if page is not None:
            run.artifact(page)
    return out | ({"report": proj.portable_ref(page)} if page is not None else {})
