"""The ``citer`` command line. Every stage command runs the same Prefect flow that its dvc stage runs.

Errors the user can fix (bad params, bad data, missing models) print one line and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from citer.cli.common import (  # noqa: F401  (``_one_line``, ``_setup``: used by tests)
    _CONSOLE,
    _OUTPUT,
    AllowPairMismatch,
    ParamsOpt,
    _one_line,
    _setup,
    _show,
    app,
    data_app,
    eval_app,
    friendly,
    labels_app,
    models_app,
    report_app,
    router_app,
    runs_flow,
)


def _start_validation_worker() -> None:
    if _CONSOLE["main"]:  # the console command only: a process that embeds the CLI gets no helper process
        from citer.data.validate import start_worker

        start_worker()


@data_app.command("validate")
@friendly
@runs_flow(preload=("mlflow",), early=_start_validation_worker)  # Great Expectations loads in the worker
def data_validate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="JSONL files; default: the configured splits")
    ] = None,
    fmt: Annotated[str | None, typer.Option("--format", "-f", help="mc or math (required with PATH)")] = None,
    params: ParamsOpt = "params.yaml",
    report: Annotated[str | None, typer.Option(help="where to write the JSON report")] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(help="model dir or hub id (repeatable): report rows longer than its context"),
    ] = None,
) -> None:
    """Validate dataset files; exit 0 when no file has errors, 1 when one has.

    Without PATH: the project's validate stage (a Prefect flow and an MLflow run; writes reports/validation.json).
    With PATH: a quick check of those files in this process, tracked nowhere (the stage's report is left alone);
    ``--report`` writes its JSON.
    """
    if paths and fmt not in ("mc", "math"):
        typer.echo("error: --format mc|math is required when PATH is given", err=True)
        raise typer.Exit(2)
    models = [str(Path(m).resolve()) if Path(m).exists() else m for m in model] if model else None
    if paths:
        reports = _check_files([(str(p.resolve()), str(fmt)) for p in paths], params, models, report)
    else:
        from flows.validate import validate_flow

        reports = validate_flow(params_path=params, files=None, report_path=report, models=models)
    for r in reports:
        typer.echo(r["summary"])
    bad = [r for r in reports if not r["ok"]]
    if bad:
        typer.echo(f"{len(bad)} of {len(reports)} file(s) refused", err=True)
        raise typer.Exit(1)


def _check_files(
    files: list[tuple[str, str]], params: str, models: list[str] | None, report: str | None
) -> list[dict[str, Any]]:
    from citer.data.validate import validate_file
    from citer.ops.io import write_json
    from citer.project import load_project

    proj = load_project(params, optional=True)
    vp = proj.params.validate_
    budget = None
    if models:
        from citer.data.lengths import load_budget

        budget = load_budget(models, proj.params.models.trust_remote_code)
    out = []
    for path, fmt in files:
        r = validate_file(
            path, fmt, max_chars_warning=vp.max_chars_warning, max_bad_row_fraction=vp.max_bad_row_fraction,
            budget=budget,
        )  # fmt: skip
        if budget is None:
            r.context = {"skipped": "pass --model DIR to check rows against a model's context"}
        out.append(r.to_dict() | {"summary": r.summary()})
    if report:
        write_json(
            proj.path(report), {"files": [{k: v for k, v in r.items() if k != "summary"} for r in out]}
        )
    return out


@data_app.command("synth")
@friendly
@runs_flow
def data_synth(params: ParamsOpt = "params.yaml") -> None:
    """Write the embedded task's train/dev/test splits (math and mc) from the synth params."""
    from flows.synth import synth_flow

    out = synth_flow(params_path=params)
    for name, n in out.get("rows", {}).items():
        typer.echo(f"{name}: {n} rows")
    if "disabled" in out:
        typer.echo(out["disabled"])


@models_app.command("bootstrap")
@friendly
@runs_flow
def models_bootstrap(params: ParamsOpt = "params.yaml") -> None:
    """Build the embedded tokenizer and pretrain the embedded SLM base and LLM from scratch."""
    from flows.bootstrap import bootstrap_flow

    _show(bootstrap_flow(params_path=params))


@models_app.command("finetune")
@friendly
@runs_flow
def models_finetune(params: ParamsOpt = "params.yaml") -> None:
    """Finetune the SLM on chain-of-thought targets (prompt tokens masked from the loss)."""
    from flows.finetune_slm import finetune_flow

    _show(finetune_flow(params_path=params))


@eval_app.command("models")
@friendly
@runs_flow
def eval_models(params: ParamsOpt = "params.yaml") -> None:
    """Greedy test accuracy of the SLM and the LLM alone; writes reports/models.json."""
    from flows.evaluate_models import eval_models_flow

    _show(eval_models_flow(params_path=params))


@eval_app.command("model")
@friendly
@runs_flow
def eval_model(
    model: Annotated[str, typer.Argument(help="model directory or hub id")],
    data: Annotated[Path, typer.Argument(help="JSONL split to evaluate on")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="mc or math")] = "math",
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 96,
    limit: Annotated[int, typer.Option(min=0, help="first N rows only (0 = all)")] = 0,
) -> None:
    """Greedy accuracy of one model alone on a dataset file."""
    if fmt not in ("mc", "math"):
        typer.echo("error: --format must be mc or math", err=True)
        raise typer.Exit(2)
    from flows.evaluate_models import eval_one_flow

    _show(eval_one_flow(model, str(data), fmt, batch_size, max_new_tokens, limit))


@eval_app.command("loglikelihood")
@friendly
def eval_loglikelihood(
    data: Annotated[Path, typer.Argument(help="mc JSONL split to grade")],
    limit: Annotated[int, typer.Option(min=0, help="first N rows only (0 = all)")] = 0,
    params: ParamsOpt = "params.yaml",
) -> None:
    """Grade mc questions without generating: the champion's routed log-likelihood of each choice, likeliest wins."""
    from citer.data.jsonl import read_jsonl
    from citer.evaluation.loglikelihood import grade_mc
    from citer.project import load_project
    from citer.serving.champion import load_champion

    rows = read_jsonl(data, "mc")
    champ = load_champion(load_project(params))
    out = grade_mc(champ.engine, champ.tokenizer, rows[:limit] if limit else rows)
    _show({k: v for k, v in out.items() if k != "predictions"} | {"router": champ.info["router"]})


@labels_app.command("collect")
@friendly
@runs_flow
def labels_collect(
    iteration: Annotated[
        int, typer.Option(min=1, help="1 = ground-truth shortcut; k >= 2 = routed rollouts")
    ] = 1,
    params: ParamsOpt = "params.yaml",
) -> None:
    """Collect token-level preference labels for one iteration."""
    from flows.collect_preferences import labels_flow

    _show(labels_flow(params_path=params, iteration=iteration))


@router_app.command("train")
@friendly
@runs_flow
def router_train(
    iteration: Annotated[int, typer.Option(min=1)] = 1,
    citer_s: Annotated[
        bool, typer.Option("--citer-s", help="train the CITER-S ablation (one-step labels)")
    ] = False,
    params: ParamsOpt = "params.yaml",
) -> None:
    """Train the MLP router on an iteration's labels (best epoch kept)."""
    from flows.train_router import router_flow

    _show(router_flow(params_path=params, iteration=iteration, citer_s=citer_s))


@router_app.command("iterate")
@friendly
@runs_flow
def router_iterate(params: ParamsOpt = "params.yaml") -> None:
    """Labels and router for iterations 1..labels.iterations, plus CITER-S; unchanged ones are kept."""
    from flows.iterate import iterate_flow

    out = iterate_flow(params_path=params)
    for key, res in out.items():
        if key != "removed":
            typer.echo(f"{key}: {'unchanged, kept' if res.get('reused') else 'made'} ({res['dir']})")
    for path in out["removed"]:
        typer.echo(f"removed stale {path}")


@eval_app.command("sweep")
@friendly
@runs_flow
def eval_sweep(params: ParamsOpt = "params.yaml") -> None:
    """Sweep tau against every baseline, choose tau, register the router and promote it if it wins."""
    from flows.sweep_and_promote import sweep_flow

    _show(sweep_flow(params_path=params))


@eval_app.command("stability")
@friendly
@runs_flow
def eval_stability(params: ParamsOpt = "params.yaml") -> None:
    """Retrain the routers with stability.seeds seeds (labels and models fixed), rerun the sweep for each and report
    every claim's spread across seeds (reports/stability.json). Run after `citer eval sweep`; not in the pipeline."""
    from flows.stability import stability_flow

    _show(stability_flow(params_path=params))


@app.command("route")
@friendly
@runs_flow
def route(
    input: Annotated[
        str | None, typer.Option(help="JSONL of questions (default: inference.input, else data.test)")
    ] = None,
    output: Annotated[
        str | None, typer.Option(help="JSONL of answers (default: params inference.output)")
    ] = None,
    llm_fraction: Annotated[
        float | None,
        typer.Option(
            min=0.0, max=1.0, help="route this share of tokens to the LLM (instead of the champion's tau)"
        ),
    ] = None,
    params: ParamsOpt = "params.yaml",
    allow_pair_mismatch: AllowPairMismatch = False,
) -> None:
    """Routed batch inference with the champion router; resumes where a previous run stopped.

    Without --input/--output: the pipeline's batch stage (inference.output, reports/report.html, an MLflow run).
    With them: a side run that writes only --output and its .meta.json/.summary.json beside it.
    """
    from flows.batch_inference import batch_inference_flow

    if input is not None and output is None:
        typer.echo("error: --input needs --output (inference.output holds the pipeline's own run)", err=True)
        raise typer.Exit(2)
    out = batch_inference_flow(
        params_path=params,
        input=input,
        output=output,
        llm_fraction=llm_fraction,
        allow_pair_mismatch=allow_pair_mismatch,
    )
    _show(out)
    if "report" in out and not _OUTPUT["json"]:  # the last dvc stage: end on what a person wants to know
        _headline(params, "the run so far:", None)


def _headline(params: str, title: str, mlflow_run: str | None) -> None:
    """The closing table: the pair's accuracy, the promoted point, the claims, and where to look next."""
    from citer.evaluation.headline import headline_rows
    from citer.project import load_project

    proj = load_project(params)
    rows, files = headline_rows(proj.reports)
    width = max(len(label) for label, _ in rows)
    typer.echo(title)
    outcome = _outcome(proj)
    if outcome:  # nothing promoted: that is the news, before any number
        typer.echo(f"  {outcome}")
    for label, value in rows:
        typer.echo(f"  {label:<{width}}  {value}")
    typer.echo(
        f"  look at: {proj.portable_ref(proj.reports)}/report.html ({', '.join(files)}; provenance.json)"
    )
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None or uri == proj.tracking_uri:  # the project's own store: as params write it (relative)
        uri = proj.params.paths.mlflow_tracking_uri
    run = f"MLflow run {mlflow_run}: " if mlflow_run else "MLflow: "
    typer.echo(f"  {run}mlflow ui --backend-store-uri {uri}")


def _outcome(proj: Any) -> str | None:
    """The line the closing table leads with when the last sweep promoted nothing: no champion (and why), or the
    champion that stays."""
    import json

    from citer.tracking.deployed import no_champion_reason

    try:
        promo = json.loads((proj.reports / "promotion.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if promo.get("promoted"):
        return None
    reason = no_champion_reason(proj)
    if reason is not None:
        return f"no champion: {reason}; `citer route` wrote an empty predictions file saying so"
    return f"not promoted: {promo.get('reason', '')}; the champion stays"


@app.command("pipeline")
@friendly
@runs_flow
def pipeline(params: ParamsOpt = "params.yaml") -> None:
    """Run every stage in order as one Prefect flow with nested MLflow runs."""
    from flows.pipeline import pipeline_flow

    out = pipeline_flow(params_path=params)
    _headline(params, "pipeline finished:", out.get("mlflow_run"))


@app.command("serve")
@friendly
def serve_cmd(
    params: ParamsOpt = "params.yaml",
    host: Annotated[
        str | None,
        typer.Option(help="default: serve.host; other than loopback needs the key in serve.api_key_env set"),
    ] = None,
    port: Annotated[int | None, typer.Option(help="default: serve.port")] = None,
    llm_fraction: Annotated[
        float | None,
        typer.Option(
            min=0.0, max=1.0, help="route this share of tokens to the LLM (default: serve.llm_fraction)"
        ),
    ] = None,
    allow_pair_mismatch: AllowPairMismatch = False,
) -> None:
    """Serve the registry's champion router behind an OpenAI-compatible API (streaming included)."""
    from citer.ops.threads import set_stage_threads
    from citer.project import load_project
    from citer.serving.server import serve_champion

    proj = load_project(params)
    set_stage_threads(proj)  # as a stage picks them: one for small models, else the cores free now
    serve_champion(
        proj,
        host=host,
        port=port,
        llm_fraction=llm_fraction,
        allow_pair_mismatch=allow_pair_mismatch,
    )


@report_app.command("html")
@friendly
def report_html(
    reports: Annotated[Path, typer.Option(help="the reports directory")] = Path("reports"),
    predictions: Annotated[Path, typer.Option(help="batch-inference output with token spans")] = Path(
        "outputs/predictions.jsonl"
    ),
    out: Annotated[Path | None, typer.Option(help="default: REPORTS/report.html")] = None,
) -> None:
    """Rebuild reports/report.html (headline, every method with intervals, the plot, who wrote which token)."""
    from citer.evaluation.html_report import write_report

    typer.echo(f"wrote {write_report(reports, predictions, out or reports / 'report.html')}")


@report_app.command("docs")
@friendly
def report_docs(
    docs: Annotated[list[Path] | None, typer.Argument(help="documents with citer blocks")] = None,
    reports: Annotated[Path, typer.Option(help="the reports directory the blocks are rendered from")] = Path(
        "reports"
    ),
    check: Annotated[
        bool, typer.Option(help="change nothing; exit 1 if a block differs from its reports")
    ] = False,
) -> None:
    """Re-render the measured tables in README.md, docs/results.md and docs/gpu.md from the report files."""
    from citer.evaluation.docs_blocks import blocks_in, render_blocks, rewrite

    stale = []
    for doc in docs or [Path("README.md"), Path("docs/results.md"), Path("docs/gpu.md")]:
        if check:
            held = blocks_in(doc.read_text(encoding="utf-8"))
            fresh = render_blocks(reports, list(held))
            stale += [f"{doc}: {n}" for n, body in held.items() if body != fresh[n][0]]
        else:
            typer.echo(f"{doc}: {', '.join(rewrite(doc, reports)) or 'no citer blocks'}")
    if stale:
        typer.echo("blocks that differ from the reports: " + "; ".join(stale), err=True)
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry
    from citer.ops.openmp import set_wait_env

    set_wait_env()  # before torch is imported: how OpenMP's waiting threads wait (citer.ops.openmp)
    # friendly() starts the reaper, and under `dvc repro` joins the repro's Prefect server first
    _CONSOLE["main"] = True
    if len(sys.argv) > 1 and sys.argv[1] not in {"--help", "-h"}:
        from citer.ops.interrupt import install

        install()  # Ctrl-C / SIGTERM: one line and exit 130 / 143 within seconds, runs closed as KILLED
    try:
        code = app()
    except SystemExit as exc:
        code = exc.code
    _exit(code)


def _exit(code: Any) -> None:  # pragma: no cover - console entry
    """Exit as ``sys.exit(code)`` would, without tearing down the interpreter: the exit hooks run and the threads are
    waited for (Prefect's queues drained, runs closed, servers and workers stopped, logs flushed), but freeing every
    module of torch, MLflow, Prefect and Great Expectations one object at a time (1-1.5 s a command, measured) is left
    to the OS."""
    import atexit
    import threading

    if code is not None and not isinstance(code, int):  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter's own exit does first, in its order: threading's exit hooks (Prefect drains its event and
    # log queues to the API there), the wait for non-daemon threads, then the atexit handlers.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
