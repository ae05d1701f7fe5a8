"""``citer report``: what the reports say, as a page to look at and as the docs' measured tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from citer.cli.common import friendly, report_app


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
    """Re-render the measured tables in README.md and docs/results.md from the report files."""
    from citer.evaluation.headline import blocks_in, render_blocks, rewrite

    stale = []
    for doc in docs or [Path("README.md"), Path("docs/results.md")]:
        if check:
            held = blocks_in(doc.read_text(encoding="utf-8"))
            fresh = render_blocks(reports, list(held))
            stale += [f"{doc}: {n}" for n, body in held.items() if body != fresh[n][0]]
        else:
            typer.echo(f"{doc}: {', '.join(rewrite(doc, reports)) or 'no citer blocks'}")
    if stale:
        typer.echo("blocks that differ from the reports: " + "; ".join(stale), err=True)
        raise typer.Exit(1)
