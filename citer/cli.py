"""The ``citer`` command line. Every stage command runs the same Prefect flow that its dvc stage runs.

Errors the user can fix (bad params, bad data, missing models) print one line and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])
data_app = typer.Typer(no_args_is_help=True, help="Datasets: synthesise the embedded task, validate files.")
models_app = typer.Typer(no_args_is_help=True, help="Models: bootstrap the embedded pair, finetune the SLM.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluation: models alone, the tau sweep with baselines.")
labels_app = typer.Typer(no_args_is_help=True, help="Token-level preference labels.")
router_app = typer.Typer(no_args_is_help=True, help="The MLP router.")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
app.add_typer(eval_app, name="eval")
app.add_typer(labels_app, name="labels")
app.add_typer(router_app, name="router")

ParamsOpt = Annotated[str, typer.Option("--params", "-p", help="params.yaml of the project")]


def _setup() -> None:
    from flows.common import quiet_defaults

    quiet_defaults()


def friendly(fn: F) -> F:
    """Turn the library's user-facing errors into one line on stderr and exit code 1.

    A command's params file is checked here, before any flow starts, so a bad key fails fast and quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _setup()
        try:
            params = kwargs.get("params")
            if params is not None and (Path(params).exists() or not kwargs.get("paths")):
                from citer.config import load_params

                load_params(params)
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@data_app.command("validate")
@friendly
def data_validate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="JSONL files; default: the configured splits")
    ] = None,
    fmt: Annotated[str | None, typer.Option("--format", "-f", help="mc or math (required with PATH)")] = None,
    params: ParamsOpt = "params.yaml",
    report: Annotated[str | None, typer.Option(help="where to write the JSON report")] = None,
) -> None:
    """Validate dataset files; exit 0 when no file has errors, 1 when one has."""
    if paths and fmt not in ("mc", "math"):
        typer.echo("error: --format mc|math is required when PATH is given", err=True)
        raise typer.Exit(2)
    from flows.validate import validate_flow

    files = [(str(p.resolve()), fmt) for p in paths] if paths else None
    reports = validate_flow(params_path=params, files=files, report_path=report)
    for r in reports:
        typer.echo(r["summary"])
    bad = [r for r in reports if not r["ok"]]
    if bad:
        typer.echo(f"{len(bad)} of {len(reports)} file(s) refused", err=True)
        raise typer.Exit(1)


@data_app.command("synth")
@friendly
def data_synth(params: ParamsOpt = "params.yaml") -> None:
    """Write the embedded task's train/dev/test splits (math and mc) from the synth params."""
    from flows.synth import synth_flow

    out = synth_flow(params_path=params)
    for name, n in out["rows"].items():
        typer.echo(f"{name}: {n} rows")


def _show(result: Any) -> None:
    import json

    typer.echo(json.dumps(result, indent=2, default=str))


@models_app.command("bootstrap")
@friendly
def models_bootstrap(params: ParamsOpt = "params.yaml") -> None:
    """Build the embedded tokenizer and pretrain the embedded SLM base and LLM from scratch."""
    from flows.bootstrap import bootstrap_flow

    _show(bootstrap_flow(params_path=params))


@models_app.command("finetune")
@friendly
def models_finetune(params: ParamsOpt = "params.yaml") -> None:
    """Finetune the SLM on chain-of-thought targets (prompt tokens masked from the loss)."""
    from flows.finetune_slm import finetune_flow

    _show(finetune_flow(params_path=params))


@eval_app.command("models")
@friendly
def eval_models(params: ParamsOpt = "params.yaml") -> None:
    """Greedy test accuracy of the SLM and the LLM alone; writes reports/models.json."""
    from flows.evaluate_models import eval_models_flow

    _show(eval_models_flow(params_path=params))


@eval_app.command("model")
@friendly
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


@labels_app.command("collect")
@friendly
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


@eval_app.command("sweep")
@friendly
def eval_sweep(params: ParamsOpt = "params.yaml") -> None:
    """Sweep tau against every baseline, choose tau, register the router and promote it if it wins."""
    from flows.sweep_and_promote import sweep_flow

    _show(sweep_flow(params_path=params))


@app.command("route")
@friendly
def route(
    input: Annotated[
        str | None, typer.Option(help="JSONL of questions (default: inference.input, else data.test)")
    ] = None,
    output: Annotated[
        str | None, typer.Option(help="JSONL of answers (default: params inference.output)")
    ] = None,
    params: ParamsOpt = "params.yaml",
) -> None:
    """Routed batch inference with the champion router; resumes where a previous run stopped."""
    from flows.batch_inference import batch_inference_flow

    _show(batch_inference_flow(params_path=params, input=input, output=output))


@app.command("pipeline")
@friendly
def pipeline(params: ParamsOpt = "params.yaml") -> None:
    """Run every stage in order as one Prefect flow with nested MLflow runs."""
    from flows.pipeline import pipeline_flow

    out = pipeline_flow(params_path=params)
    typer.echo(f"pipeline finished: {sorted(out)}")


@app.command("serve")
@friendly
def serve_cmd(
    params: ParamsOpt = "params.yaml",
    host: Annotated[str | None, typer.Option(help="default: serve.host")] = None,
    port: Annotated[int | None, typer.Option(help="default: serve.port")] = None,
) -> None:
    """Serve the registry's champion router behind an OpenAI-compatible API (streaming included)."""
    from citer.project import load_project
    from citer.serving.server import serve_champion

    serve_champion(load_project(params), host=host, port=port)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
