"""``reports/report.html``: one self-contained page to look at a run (no scripts, no files beside it).

What it shows, all read from files the pipeline wrote: the headline (the pair, the promoted point, the claims as
:mod:`citer.evaluation.headline` states them), every method at its dev-chosen point on test with intervals, the
accuracy/bytes plot (``pareto.png``, embedded), and a token view of sample answers from batch inference with each
piece of text coloured by the model that wrote it (``spans`` of ``outputs/predictions.jsonl``). ``citer report html``
rebuilds it; the batch-inference stage writes it at the end of a pipeline.
"""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path
from typing import Any

from citer.evaluation.headline import headline_rows
from citer.ops.io import write_text

_STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #1b1b1b; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5rem 0; } td, th { border: 1px solid #ddd; padding: .25rem .5rem; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.oracle td { color: #666; font-style: italic; } tr.promoted td { font-weight: 600; }
.question { color: #444; margin: .2rem 0; } .status { border-left: 4px solid #a11; padding: .3rem .6rem; }
.run { color: #555; font-size: .9rem; }
.answer { font-family: ui-monospace, monospace; white-space: pre-wrap; background: #fafafa; border: 1px solid #e4e4e4;
          padding: .5rem; margin: .4rem 0 1rem; }
.tok.llm { background: #ffd58a; border-radius: 3px; } .tok.slm { color: #1d3f73; }
.tok.rolled_back { color: #9a9a9a; text-decoration: line-through; }
.key { display: inline-block; padding: 0 .4rem; margin-right: .6rem; }
.ok { color: #17702f; } .bad { color: #a11; } img { max-width: 100%; }
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _fmt(v: Any, ci: list[Any] | None = None, digits: int = 3) -> str:
    if v is None:
        return "–"
    out = f"{v:.{digits}f}"
    if ci:
        lo, hi = ("–" if c is None else f"{c:.{digits}f}" for c in ci)
        out += f" [{lo}, {hi}]"
    return out


def _sweep_table(rows: list[dict[str, Any]], promoted: str | None) -> str:
    """Every method at its dev-chosen point; the promoted method's row in bold (none when nothing was promoted)."""
    body = []
    priced = next((r["priced_at"] for r in rows if r.get("priced_at")), None)  # the reference pair, if any
    for r in rows:
        if r.get("tau") is not None and not r.get("selected_on_dev"):
            continue
        cls = "promoted" if r["method"] == promoted else "oracle" if r["method"] == "oracle" else ""
        tau = "–" if r.get("tau") is None else f"{r['tau']:.3f}"
        cells = [_esc(r["method"]), tau, _fmt(r["accuracy"], r.get("accuracy_ci")),
                 _fmt(r.get("llm_token_fraction")), _fmt(r["bytes_moved_rel_llm"], r.get("bytes_ci"))]  # fmt: skip
        if priced:
            cells.append(_fmt(r.get("bytes_priced_rel_llm"), r.get("bytes_priced_ci")))
        body.append(f'<tr class="{cls}">' + "".join(
            f'<td class="num">{c}</td>' if i else f"<td>{c}</td>" for i, c in enumerate(cells)) + "</tr>")  # fmt: skip
    heads = ["method", "τ (dev)", "test accuracy [95%]", "LLM tokens", "bytes / LLM-only [95%]"]
    if priced:
        heads.append(f"bytes / LLM-only priced at {_esc(priced)} [95%]")
    head = "".join(f"<th>{h}</th>" for h in heads)
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _answers(preds: list[dict[str, Any]], n: int) -> tuple[str, int, int]:
    """The token view of the first ``n`` answers with spans; returns (html, LLM pieces, SLM pieces)."""
    out, n_llm, n_slm = [], 0, 0
    shown = [p for p in preds if p.get("spans")][:n]
    for p in shown:
        pieces = []
        for text, who in p["spans"]:
            title = "SLM, taken back by the LLM's check" if who == "rolled_back" else who.upper()
            pieces.append(f'<span class="tok {who}" title="{title}">{_esc(text)}</span>')
            n_llm += who == "llm"
            n_slm += who == "slm"
        verdict = ""
        if "correct" in p:
            verdict = '<span class="ok">correct</span>' if p["correct"] else '<span class="bad">wrong</span>'
        share = f"{p.get('llm_tokens', 0)} of {p.get('n_tokens', 0)} tokens from the LLM"
        question = f'<p class="question">{_esc(p["question"])}</p>' if p.get("question") else ""
        out.append(
            f'<p>Question {p["index"]} ({share}) {verdict}</p>{question}<div class="answer">{"".join(pieces)}</div>'
        )
    return "".join(out), n_llm, n_slm


def _status(reports: Path, predictions: str | os.PathLike[str] | None) -> str:
    """The outcome first when nothing was promoted: the batch stage's ``no champion`` status, or the gate that held."""
    text = None
    if predictions is not None:
        meta = Path(f"{predictions}.meta.json")
        if meta.is_file():
            text = json.loads(meta.read_text(encoding="utf-8")).get("status")
    promo = reports / "promotion.json"
    if text is None and promo.is_file():
        rec = json.loads(promo.read_text(encoding="utf-8"))
        if not rec.get("promoted") and rec.get("reason"):
            text = f"not promoted: {rec['reason']}"
    return f'<p class="status">{_esc(text)}</p>' if text else ""


def _run_line(reports: Path) -> str:
    """Which params the sweep ran with (their digest, ``provenance.json``). The page is a result file, the same
    for two runs of the same code: when, where and in which MLflow run are in ``reports/provenance.json``."""
    from citer.tracking.provenance import read

    files = read(reports)["files"]
    entry = next((v for k, v in files.items() if Path(k).name == "sweep.json"), None)
    if entry is None:
        return ""
    return (
        f'<p class="run">Sweep of params {_esc(str(entry.get("params_digest") or "?"))}; the run that wrote it '
        f"(commit, machine, time, MLflow run): <code>reports/provenance.json</code>.</p>"
    )


def build_report(
    reports: str | os.PathLike[str], predictions: str | os.PathLike[str] | None, n_answers: int = 8
) -> str:
    """The page's HTML from ``reports`` (and ``predictions``, when the file exists)."""
    d = Path(reports)
    rows, files = headline_rows(d)
    promo = json.loads((d / "promotion.json").read_text(encoding="utf-8"))
    promoted = (promo.get("method") or "citer") if promo.get("promoted") else None
    head = "".join(f"<tr><th>{_esc(a)}</th><td>{_esc(b)}</td></tr>" for a, b in rows)
    sweep = json.loads((d / "sweep.json").read_text(encoding="utf-8"))
    png = d / "pareto.png"
    plot = (
        f'<img alt="accuracy vs bytes on test" src="data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}">'
        if png.is_file()
        else "<p>(no pareto.png)</p>"
    )
    preds: list[dict[str, Any]] = []
    if predictions is not None and Path(predictions).is_file():
        preds = [
            json.loads(x) for x in Path(predictions).read_text(encoding="utf-8").splitlines() if x.strip()
        ]
    answers, n_llm, n_slm = _answers(preds, n_answers)
    if not answers:
        answers = "<p>No batch-inference output with token spans yet (run <code>citer route</code>).</p>"
    legend = ('<p><span class="key tok slm">SLM</span><span class="key tok llm">LLM</span>'
              '<span class="key tok rolled_back">taken back (verified routing)</span>'
              f'<span id="counts">{n_llm} LLM pieces, {n_slm} SLM pieces shown</span></p>')  # fmt: skip
    src = ", ".join(f"reports/{f}" for f in files)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>citer report</title><style>{_STYLE}</style></head>
<body>
<h1>citer: routed decoding report</h1>
{_status(d, predictions)}<p>Every number on <b>test</b> at the point chosen on <b>dev</b>, 95% paired-bootstrap
intervals in brackets. From {_esc(src)}.</p>{_run_line(d)}
<h2>Headline</h2><table>{head}</table>
<h2>Every method at its dev-chosen point</h2>{_sweep_table(sweep, promoted)}
<h2>Accuracy against bytes moved</h2>{plot}
<h2>Who wrote which token</h2>{legend}{answers}
</body></html>
"""


def write_report(
    reports: str | os.PathLike[str], predictions: str | os.PathLike[str] | None, out: str | os.PathLike[str]
) -> Path:
    """Write :func:`build_report` to ``out`` atomically."""
    write_text(out, build_report(reports, predictions))
    return Path(out)
