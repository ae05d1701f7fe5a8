"""What every ``citer`` command shares: the Typer apps, the global options, one-line errors and the result printer."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="citer: token-level routed decoding between a small and a large language model.",
)
data_app = typer.Typer(no_args_is_help=True, help="Datasets: synthesise the embedded task, validate files.")
models_app = typer.Typer(no_args_is_help=True, help="Models: bootstrap the embedded pair, finetune the SLM.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluation: models alone, the tau sweep with baselines.")
labels_app = typer.Typer(no_args_is_help=True, help="Token-level preference labels.")
router_app = typer.Typer(no_args_is_help=True, help="The MLP router.")
report_app = typer.Typer(no_args_is_help=True, help="What the reports say, for people and for the docs.")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
app.add_typer(eval_app, name="eval")
app.add_typer(labels_app, name="labels")
app.add_typer(router_app, name="router")
app.add_typer(report_app, name="report")

ParamsOpt = Annotated[str, typer.Option("--params", "-p", help="params.yaml of the project")]
AllowPairMismatch = Annotated[
    bool,
    typer.Option(
        "--allow-pair-mismatch",
        help="use a champion trained for other SLM/LLM files than params name (warns; the rare deliberate case)",
    ),
]


_OUTPUT = {"json": False}
# True in the `citer` console command (main()), not in a process that embeds the app (a test's CliRunner)
_CONSOLE = {"main": False}


@app.callback()
def _global(
    debug: Annotated[
        bool, typer.Option("--debug", envvar="CITER_DEBUG", help="show tracebacks and the tools' own logs")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", envvar="CITER_JSON", help="print each stage's full result as JSON")
    ] = False,
) -> None:
    """citer: token-level routed decoding between a small and a large language model."""
    if debug:
        os.environ["CITER_DEBUG"] = "1"
    _OUTPUT["json"] = as_json  # set on every invocation (a test's CliRunner reuses the process)


def _setup() -> None:
    from flows.common import quiet_defaults

    quiet_defaults()


# Errors a user causes and can fix (params, data, models, registry state): their message is the whole story.
# Anything else is a bug or an environment problem: one line too, naming the exception type, and --debug for more.
EXPECTED = (ValueError, OSError, KeyError, ImportError)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, EXPECTED) and first:
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def friendly(fn: F) -> F:
    """Every error a command raises ends here: one line on stderr and exit code 1 (130 on Ctrl-C).

    With ``--debug`` (or ``CITER_DEBUG=1``) the traceback comes first. A command's params file, and the devices,
    models and data it points at (:mod:`citer.ops.preflight`), are checked before any flow starts, so a bad key or a
    missing device fails fast and quietly.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _setup()
        try:
            flow = getattr(fn, "runs_flow", None)
            if flow is not None and flow["early"] is not None:  # work for another core, before anything else
                flow["early"]()
            if _CONSOLE["main"]:
                _console_start(flow is not None and not kwargs.get("paths"))
            params = kwargs.get("params")
            if params is not None and (Path(params).exists() or not kwargs.get("paths")):
                from citer.config import load_params

                load_params(params)
            # a stage: what params point at, before Prefect starts
            if params is not None and not kwargs.get("paths"):
                from citer.ops.preflight import preflight
                from citer.project import load_project

                preflight(load_project(params), params)
            # params are good and a flow will run (not a quick check of named files): boot its server, import meanwhile
            # (the console command; a process that embeds the app leaves the server to Prefect, as Prefect does)
            if flow is not None and not kwargs.get("paths"):
                from citer.cli.prefect_server import boot, flow_settings

                if _CONSOLE["main"]:
                    boot()(flow["preload"])
                with flow_settings():
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            _interrupted()
        except Exception as exc:
            from citer.ops import interrupt

            # what fell over while a Ctrl-C unwound: the Ctrl-C is the story
            if interrupt.interrupted() is not None:
                _interrupted()
            if os.environ.get("CITER_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}:
                traceback.print_exc()
            hint = "" if isinstance(exc, EXPECTED) else " (rerun with --debug for the traceback)"
            typer.echo(f"error: {_one_line(exc)}{hint}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _console_start(runs_flow: bool) -> None:
    """What the console command starts before its work: under `dvc repro`, the repro's Prefect server (found or
    started: :func:`citer.cli.prefect_server.join_repro_server`), then the reaper, which takes the command's children
    with it if the command is SIGKILLed (the shared server is started first so that it is never one of them)."""
    if runs_flow and os.environ.get("DVC_STAGE"):
        from citer.cli.prefect_server import join_repro_server

        join_repro_server()
    from citer.ops.reaper import start_reaper

    start_reaper()


def runs_flow(
    fn: F | None = None,
    *,
    preload: tuple[str, ...] = ("mlflow", "torch"),
    early: Callable[[], Any] | None = None,
) -> Any:
    """Mark a command that runs a Prefect flow (under :func:`friendly`): its temporary server
    (:mod:`citer.cli.prefect_server`) boots once its params are checked, and the modules in ``preload`` are imported
    while it boots (none when a running server is used: each is imported where it is needed). ``early`` is called
    first of all (e.g. to start a helper process). ``@runs_flow`` or ``@runs_flow(preload=..., early=...)``."""

    def mark(f: F) -> F:
        f.runs_flow = {"preload": preload, "early": early}  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


def _interrupted() -> None:
    """Ctrl-C (or SIGTERM): close the runs still open, one line, exit 130 (143)."""
    from citer.ops import interrupt

    interrupt.run_callbacks()
    interrupt.say_once()
    interrupt.stop_children()  # Prefect's temporary server, dask workers: the stage's children go with it
    raise typer.Exit(interrupt.exit_code()) from None


def _brief(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        parts = [f"{k}={_brief(x)}" for k, x in v.items() if not isinstance(x, (dict, list))][:6]
        return ", ".join(parts) + (" …" if len(v) > len(parts) else "") if parts else f"{len(v)} fields"
    if isinstance(v, list):
        return f"{len(v)} items"
    return str(v)


def _show(result: Any) -> None:
    """A stage's result for a person: one line per top-level field (``--json``: all of it, as JSON; the full
    figures are in the stage's report files either way)."""
    import json

    if _OUTPUT["json"]:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    if isinstance(result, dict) and "disabled" in result:  # a disabled stage says so in one line
        typer.echo(result["disabled"])
        return
    if not isinstance(result, dict):
        typer.echo(_brief(result))
        return
    for k, v in result.items():
        typer.echo(f"{k}: {_brief(v)}")
