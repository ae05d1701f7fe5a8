"""The sweep's files: reports/sweep.json (exactly the contract keys), the details, the claims, plot data and the PNG.

Every file is written atomically (``citer.ops.io``).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from citer.evaluation.intervals import attach_intervals
from citer.evaluation.pareto import claims
from citer.evaluation.pricing import labelled, priced_view
from citer.evaluation.sweep_rows import METHODS, SweepError, SweepRow, rows_of
from citer.ops.io import atomic_dir, atomic_path, write_json


def write_sweep(
    path: str | os.PathLike[str], rows: Sequence[SweepRow], details_path: str | os.PathLike[str] | None = None
) -> Path:
    """``reports/sweep.json``: the rows of :data:`METHODS` with exactly :data:`SWEEP_KEYS`.

    ``details_path`` (e.g. reports/sweep_details.json) gets every row with every field (projected GPU time, example
    counts, extras, and rows such as the re-evaluated champion that are not sweep methods).
    """
    out = [r.to_json() for r in rows if r.method in METHODS]
    write_json(path, out)
    if details_path is not None:
        write_json(details_path, [r.to_details() for r in rows])
    return Path(path)


def sweep_measured(result: Any) -> dict[str, Any]:
    """The sweep's wall-clock figures by split, one ``[method, tau, {sec_per_token, pass_seconds}]`` per row, in
    the rows' order: kept in ``reports/provenance.json``'s ``run_facts``, not in the report files."""
    return {
        split: [[r.method, r.tau, r.measured()] for r in getattr(result, split)] for split in ("test", "dev")
    }


def read_sweep(path: str | os.PathLike[str]) -> list[SweepRow]:
    """Rows back from sweep.json or sweep_details.json."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SweepError(f"{p}: not valid JSON ({exc})") from exc
    if not isinstance(raw, list):
        raise SweepError(f"{p}: expected a list of rows")
    out = []
    for i, d in enumerate(raw):
        try:
            out.append(SweepRow.from_dict(d))
        except (SweepError, TypeError) as exc:
            raise SweepError(f"{p}: row {i}: {exc}") from exc
    return out


PLOT_COLUMNS = ("tau", "bytes_moved_rel_llm", "accuracy", "llm_token_fraction")


def plot_points(rows: Sequence[SweepRow]) -> list[dict[str, Any]]:
    """Flat records (method, tau, bytes_moved_rel_llm, accuracy, llm_token_fraction) of the sweep methods."""
    keep = [r for r in rows if r.method in METHODS]
    keep.sort(key=lambda r: (METHODS.index(r.method), r.bytes_moved_rel_llm, r.accuracy))
    return [{"method": r.method, **{c: getattr(r, c) for c in PLOT_COLUMNS}} for r in keep]


def write_pareto_json(path: str | os.PathLike[str], rows: Sequence[SweepRow]) -> Path:
    """``reports/pareto.json`` for ``dvc plots`` (x: bytes_moved_rel_llm, y: accuracy): :func:`plot_points`."""
    write_json(path, plot_points(rows))
    return Path(path)


def write_plot_data(dir_path: str | os.PathLike[str], rows: Sequence[SweepRow]) -> Path:
    """One CSV per method (``{dir}/{method}.csv``, sorted by bytes) for ``dvc plots``: DVC draws one curve per file."""
    with atomic_dir(dir_path) as tmp:
        for m in METHODS:
            mine = sorted(rows_of(rows, m), key=lambda r: (r.bytes_moved_rel_llm, r.accuracy))
            if not mine:
                continue
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(("method",) + PLOT_COLUMNS)
            for r in mine:
                w.writerow(
                    (
                        m,
                        "" if r.tau is None else r.tau,
                        r.bytes_moved_rel_llm,
                        r.accuracy,
                        r.llm_token_fraction,
                    )
                )
            (tmp / f"{m}.csv").write_text(buf.getvalue(), encoding="utf-8")
    return Path(dir_path)


_STYLE = {
    "citer": ("C3", "o", "-"),
    "citer_iter1": ("C3", "o", ":"),
    "citer_s": ("C1", "s", "-"),
    "citer_emb": ("C5", "<", ":"),
    "citer_logits": ("C6", ">", ":"),
    "citer_emb_logits": ("C8", "d", ":"),
    "oracle": ("k", "X", ""),
    "random": ("C7", "x", "--"),
    "confidence": ("C2", "^", "--"),
    "query": ("C4", "v", "--"),
    "slm": ("k", "P", ""),
    "llm": ("k", "*", ""),
    "speculative": ("C0", "D", ""),
    "citer_verify": ("C9", "h", "-"),
    "bild": ("C2", "p", "-."),
}


def plot_pareto(rows: Sequence[SweepRow], path_png: str | os.PathLike[str], title: str | None = None) -> Path:
    """Accuracy against bytes moved (x LLM-only), one curve per method, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    for m in METHODS:
        mine = sorted(rows_of(rows, m), key=lambda r: r.bytes_moved_rel_llm)
        if not mine:
            continue
        color, marker, ls = _STYLE[m]
        ax.plot(
            [r.bytes_moved_rel_llm for r in mine],
            [r.accuracy for r in mine],
            color=color,
            marker=marker,
            linestyle=ls or "none",
            label=m,
            markersize=6,
        )
    ax.set_xlabel("bytes moved (relative to LLM-only)")
    ax.set_ylabel("accuracy")
    ax.set_title(title or "CITER: accuracy vs cost")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    with atomic_path(path_png) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    return Path(path_png)


def write_sweep_reports(reports_dir: str | os.PathLike[str], result: Any, params: Any) -> dict[str, Any]:
    """The sweep stage's files under ``reports_dir`` from a :class:`citer.evaluation.sweep.SweepResult`:
    sweep.json (test, with intervals), sweep_details.json (test, every field), sweep_dev.json (the dev rows every
    choice was made on), sweep_claims.json (claims with intervals, and the protocol: each method's thresholds and
    dev choice), pareto.json, pareto/ and pareto.png. ``params``: the sweep params. Returns the claims."""
    d = Path(reports_dir)
    iv = params.intervals
    attach_intervals(result.test, n_resamples=iv.resamples, seed=params.seed, level=iv.level)
    priced = priced_view(result.test)  # the same rows at the reference pair: the same intervals and claims
    if priced is not None:
        attach_intervals(priced, n_resamples=iv.resamples, seed=params.seed, level=iv.level)
        for r, v in zip(result.test, priced, strict=True):
            r.bytes_priced_ci = v.bytes_ci
    write_sweep(d / "sweep.json", result.test, d / "sweep_details.json")
    write_json(
        d / "sweep_dev.json",
        [
            r.to_details() | {"correct": [], "question_bytes": [], "question_bytes_priced": []}
            for r in result.dev
        ],
    )
    write_pareto_json(d / "pareto.json", result.test)
    write_plot_data(d / "pareto", result.test)
    plot_pareto(result.test, d / "pareto.png", "accuracy vs bytes on test (points chosen on dev)")
    found = claims_both(result.test, params)
    found["protocol"] = {
        "selected_on": "dev",
        "reported_on": "test",
        **result.notes,
        "methods": {
            m: {
                "thresholds": [[f, t] for f, t in result.thresholds.get(m, [])],
                "chosen_on_dev": None
                if row is None
                else {
                    "tau": row.tau,
                    "target_llm_fraction": row.extra.get("target_llm_fraction"),
                    "dev_accuracy": row.accuracy,
                    "dev_bytes_moved_rel_llm": row.bytes_moved_rel_llm,
                },
            }
            for m, row in result.chosen.items()
        },
    }
    write_json(d / "sweep_claims.json", found)
    return found


def every_claim(rows: Sequence[SweepRow], params: Any) -> dict[str, Any]:
    """CITER's claims, and the verified decoder's own (vs the oracle, speculative decoding, BiLD and the plain
    router) under ``verified``."""
    iv = params.intervals
    found = claims(
        rows, params.rule.accuracy_ratio, n_resamples=iv.resamples, seed=params.seed, level=iv.level
    )
    found["verified"] = {
        m: claims(rows, params.rule.accuracy_ratio, iv.resamples, params.seed, iv.level, method=m)
        for m in ("citer_verify",)
        if any(r.method == m for r in rows)
    }
    return found


def claims_both(rows: Sequence[SweepRow], params: Any) -> dict[str, Any]:
    """:func:`every_claim` on the measured bytes, and under ``priced`` the same claims at the reference pair (each
    statement labelled with it) when the rows carry priced bytes."""
    found = every_claim(rows, params)
    priced = priced_view(rows)
    if priced is not None:
        name = rows[0].priced_at
        found["priced"] = {"priced_at": name, **labelled(every_claim(priced, params), name)}
    return found


def sweep_metrics(rows: Sequence[SweepRow], found: dict[str, Any]) -> dict[str, float]:
    """Flat metrics for a tracking run: each point's accuracy and bytes, and the scalar claims."""
    out: dict[str, float] = {}
    for r in rows:
        tag = r.method if r.tau is None else f"{r.method}.tau_{r.tau:g}"
        out[f"{tag}.accuracy"] = r.accuracy
        out[f"{tag}.bytes_rel_llm"] = r.bytes_moved_rel_llm
        if r.bytes_priced_rel_llm is not None:
            out[f"{tag}.bytes_priced_rel_llm"] = r.bytes_priced_rel_llm
    for k, v in found.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[f"claims.{k}"] = v
    return out
