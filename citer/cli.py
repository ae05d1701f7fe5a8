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
app.add_typer(data_app, name="data")

ParamsOpt = Annotated[str, typer.Option("--params", "-p", help="params.yaml of the project")]


def _setup() -> None:
    from flows.common import quiet_defaults

    quiet_defaults()


def friendly(fn: F) -> F:
    """Turn the library's user-facing errors into one line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _setup()
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@data_app.command("validate")
@friendly
def data_validate(
    paths: Annotated[list[Path] | None, typer.Argument(help="JSONL files; default: the configured splits")] = None,
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


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
