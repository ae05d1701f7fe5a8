"""Dataset validation with Great Expectations: every problem of a JSONL file, with its line, field and severity.

Two layers. Lines that do not parse into a row of the format (bad JSON or UTF-8, control characters, truncation,
missing keys, wrong types, empty strings) are error findings straight from :mod:`citer.data.formats`. The rows that
do parse go into a DataFrame and through a Great Expectations suite for the format:

- errors (the file is refused): not-null and type per column, and the row rules of ``formats.RULES`` (fewer than 2
  choices, text/label length mismatch, duplicate labels, answerKey not a label, cot not ending in the answerKey, a
  solution without a balanced non-empty final box), each evaluated as a bool column expected to be in ``[True]``;
- warnings (the file passes): duplicate questions/problems and texts longer than ``max_chars_warning``;
- tolerated defects (rules of severity "warning", e.g. MATH train's two empty ``\\boxed{}``): warnings while their
  share of rows is at most ``max_bad_row_fraction`` (the expectation's ``mostly`` is 1 - that fraction), errors row by
  row above it, plus one file-level error giving the count;
- with a :class:`~citer.data.lengths.ContextBudget`: every row whose prompt + reference exceeds the models' context
  (an error: labels cannot run on it and finetuning would cut it).

``result_format="COMPLETE"`` gives failing DataFrame indexes, mapped back to line numbers. Great Expectations is
imported lazily (it takes seconds) and its ephemeral context is built once per process. A command can have it load
on another core while it does other work: :func:`start_worker` starts a helper process that imports it at once and
then runs the suites for this process (same code, same findings). Nothing is logged here: the caller logs the
returned report (``to_dict``) or writes it with :func:`write_report`.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from citer.data.formats import Format
from citer.data.jsonl import RULES, DataError, ParsedLine, iter_lines, rule_problems
from citer.data.lengths import ContextBudget, over_limit, sequence_lengths
from citer.ops.io import write_json

Severity = Literal["error", "warning"]

DEFAULT_MAX_CHARS_WARNING = 20000
DEFAULT_MAX_BAD_ROW_FRACTION = 0.001
LENGTH_FIELD = "prompt+target"
_LIST_LINES = 20  # over-long lines named in the summary's one-line digest

# Columns per format: (name, type checked by GE, whether it is required and gets length/duplicate checks).
_TEXT_COLUMNS: dict[str, tuple[str, ...]] = {"mc": ("question", "answerKey"), "math": ("problem", "solution")}
_UNIQUE_COLUMN = {"mc": "question", "math": "problem"}
_LONG_COLUMNS = {"mc": ("question", "cot"), "math": ("problem", "solution")}


@dataclass(frozen=True)
class Finding:
    line: int | None
    field: str | None
    severity: Severity
    reason: str


@dataclass
class ValidationReport:
    path: str
    fmt: str
    n_rows: int
    findings: list[Finding] = field(default_factory=list)
    # The context check: {"limit", "source", "n_over", "lines"} when it ran, {"skipped": why} when it could not.
    context: dict[str, Any] | None = None

    @property
    def n_errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)

    @property
    def n_warnings(self) -> int:
        return sum(f.severity == "warning" for f in self.findings)

    @property
    def ok(self) -> bool:
        return self.n_errors == 0

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.fmt,
            "ok": self.ok,
            "n_rows": self.n_rows,
            "n_errors": self.n_errors,
            "n_warnings": self.n_warnings,
            "context": self.context,
            "findings": [asdict(f) for f in self.findings],
        }

    def summary(self, max_findings: int = 50) -> str:
        verdict = "OK" if self.ok else "REFUSED"
        head = (
            f"{self.path} ({self.fmt}): {self.n_rows} rows, {self.n_errors} errors, "
            f"{self.n_warnings} warnings -> {verdict}"
        )
        lines = [head]
        ctx = self.context or {}
        if ctx.get("n_over"):
            shown = ", ".join(str(n) for n in ctx["lines"][:_LIST_LINES])
            more = f" and {ctx['n_over'] - _LIST_LINES} more" if ctx["n_over"] > _LIST_LINES else ""
            lines.append(
                f"  {ctx['n_over']} row(s) longer than the context of {ctx['limit']} tokens ({ctx['source']}): "
                f"lines {shown}{more}"
            )
        elif "skipped" in ctx:
            lines.append(f"  context length not checked: {ctx['skipped']}")
        for f in self.findings[:max_findings]:
            where = "file" if f.line is None else f"line {f.line}"
            what = f"{f.field}: " if f.field else ""
            lines.append(f"  {where} [{f.severity}] {what}{f.reason}")
        if len(self.findings) > max_findings:
            lines.append(f"  ... and {len(self.findings) - max_findings} more findings")
        return "\n".join(lines)


_GX_LOCK = threading.Lock()
_GX_STATE: dict[str, Any] = {}


def _gx_batch_definition() -> Any:
    """The pandas batch definition of the process-wide ephemeral context (built on first use)."""
    with _GX_LOCK:
        if "batch_def" not in _GX_STATE:
            os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
            import great_expectations as gx
            from great_expectations.data_context.types.base import ProgressBarsConfig

            ctx = gx.get_context(mode="ephemeral")
            ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
            asset = ctx.data_sources.add_pandas("citer").add_dataframe_asset("rows")
            _GX_STATE["batch_def"] = asset.add_batch_definition_whole_dataframe("all")
        return _GX_STATE["batch_def"]


def _rule_column(name: str) -> str:
    return f"rule__{name}"


def _build_suite(
    fmt: Format, max_chars_warning: int, columns: Sequence[str], max_bad_row_fraction: float
) -> Any:
    import great_expectations as gx
    from great_expectations import expectations as gxe

    suite = gx.ExpectationSuite(name=f"citer_{fmt}")

    def add(cls: Any, kind: str, column: str, **kwargs: Any) -> None:
        # meta travels into each result, so findings can be mapped back without relying on result order.
        suite.add_expectation(cls(column=column, meta={"kind": kind, "column": column}, **kwargs))

    for col in _TEXT_COLUMNS[fmt]:
        add(gxe.ExpectColumnValuesToNotBeNull, "not_null", col)
        add(gxe.ExpectColumnValuesToBeOfType, "type", col, type_="str")
    if fmt == "mc":
        add(gxe.ExpectColumnValuesToNotBeNull, "not_null", "choices")
        add(gxe.ExpectColumnValuesToBeOfType, "type", "choices", type_="dict")
    for rule in RULES[fmt]:
        if rule.severity == "warning":  # a tolerated defect: GE's mostly decides whether the file passes
            add(
                gxe.ExpectColumnValuesToBeInSet,
                "tolerated",
                _rule_column(rule.name),
                value_set=[True],
                mostly=1.0 - max_bad_row_fraction,
            )
        else:
            add(gxe.ExpectColumnValuesToBeInSet, "rule", _rule_column(rule.name), value_set=[True])
    add(gxe.ExpectColumnValuesToBeUnique, "unique", _UNIQUE_COLUMN[fmt], severity="warning")
    for col in _LONG_COLUMNS[fmt]:
        if col in columns:
            add(
                gxe.ExpectColumnValueLengthsToBeBetween,
                "length",
                col,
                max_value=max_chars_warning,
                severity="warning",
            )
    return suite


def _frame(parsed: list[ParsedLine], fmt: Format) -> tuple[Any, dict[str, list[str | None]]]:
    """The valid rows as a DataFrame (+ one bool column per rule) and, per rule, each row's failure reason."""
    import pandas as pd

    rows = [p.row for p in parsed if p.row is not None]
    data: dict[str, list[Any]] = {"line": [p.line for p in parsed if p.row is not None]}
    for col in _TEXT_COLUMNS[fmt]:
        data[col] = [r.get(col) for r in rows]
    if fmt == "mc":
        data["choices"] = [r.get("choices") for r in rows]
        if any("cot" in r for r in rows):
            data["cot"] = [r.get("cot") for r in rows]
    reasons: dict[str, list[str | None]] = {}
    for rule in RULES[fmt]:
        col = _rule_column(rule.name)
        reasons[col] = [rule.check(r) for r in rows]
        data[col] = [reason is None for reason in reasons[col]]
    return pd.DataFrame(data), reasons


_WORKER_LOCK = threading.Lock()
_WORKER: dict[str, Any] = {}


def start_worker() -> None:
    """Start importing Great Expectations now, in a helper process that will run this process's suites (the
    ``citer data validate`` command: the import, 3-5 s, runs on the other core while the command starts Prefect and
    MLflow and reads the files). Nothing starts when GE is loaded here already or ``CITER_VALIDATE_WORKER=0``. If the
    worker fails, the suites run in this process, as without it."""
    import subprocess
    from multiprocessing.connection import Connection

    with _WORKER_LOCK:
        if _WORKER or "batch_def" in _GX_STATE or os.environ.get("CITER_VALIDATE_WORKER", "").strip() == "0":
            return
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        code = "from citer.data.validate import _serve; _serve()"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(to_r), str(from_w)],
                pass_fds=(to_r, from_w),
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            os.close(to_w)
            os.close(from_r)
            return
        finally:
            os.close(to_r)
            os.close(from_w)
        _WORKER.update(
            proc=proc, send=Connection(to_w, readable=False), recv=Connection(from_r, writable=False)
        )
    import atexit

    atexit.register(stop_worker)


def stop_worker() -> None:
    with _WORKER_LOCK:
        if not _WORKER:
            return
        for end in ("send", "recv"):
            _WORKER[end].close()
        proc = _WORKER["proc"]
        _WORKER.clear()
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except Exception:  # noqa: BLE001
        proc.kill()


def _serve() -> None:  # pragma: no cover - the worker process (tests/test_cli_startup.py runs it)
    """The worker: load GE at once, then run each ``_ge_findings_here`` call it is sent until its input closes."""
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the command's to handle; it stops this process
    recv = Connection(int(sys.argv[1]), writable=False)
    send = Connection(int(sys.argv[2]), readable=False)
    _gx_batch_definition()
    while True:
        try:
            args = recv.recv()
        except EOFError:
            return
        try:
            send.send(("ok", _ge_findings_here(*args)))
        except Exception as exc:  # noqa: BLE001 - the caller runs it again in its own process, where it raises
            send.send(("error", repr(exc)))


def _ge_findings(
    df: Any,
    reasons: dict[str, list[str | None]],
    fmt: Format,
    max_chars_warning: int,
    max_bad_row_fraction: float,
) -> list[Finding]:
    args = (df, reasons, fmt, max_chars_warning, max_bad_row_fraction)
    with _WORKER_LOCK:
        if _WORKER:
            try:
                _WORKER["send"].send(args)
                status, found = _WORKER["recv"].recv()
                if status == "ok":
                    return found
            except (OSError, EOFError):  # the worker is gone: validate here from now on
                _WORKER["proc"].kill()
                _WORKER.clear()
    return _ge_findings_here(*args)


def _ge_findings_here(
    df: Any,
    reasons: dict[str, list[str | None]],
    fmt: Format,
    max_chars_warning: int,
    max_bad_row_fraction: float,
) -> list[Finding]:
    batch_def = _gx_batch_definition()  # first: a suite can only be built once a context exists
    with _GX_LOCK:  # one shared context: Prefect may validate several files from worker threads at once
        suite = _build_suite(fmt, max_chars_warning, list(df.columns), max_bad_row_fraction)
        batch = batch_def.get_batch(batch_parameters={"dataframe": df})
        result = batch.validate(suite, result_format="COMPLETE")
    rule_fields = {_rule_column(r.name): r.field for r in RULES[fmt]}
    lines = df["line"].tolist()
    out: list[Finding] = []
    for res in result.results:
        cfg = res.expectation_config
        kind, column = cfg.meta["kind"], cfg.meta["column"]
        severity: Severity = "warning" if str(cfg.severity.value) == "warning" else "error"
        if res.exception_info and res.exception_info.get("raised_exception"):
            msg = res.exception_info.get("exception_message")
            out.append(Finding(None, column, "error", f"expectation {cfg.type} could not run: {msg}"))
            continue
        if kind == "tolerated":
            out.extend(_tolerated(res, df, reasons, rule_fields[column], column, max_bad_row_fraction))
            continue
        if res.success:
            continue
        first_seen: dict[Any, int] = {}
        if kind == "unique":
            for i, value in enumerate(df[column].tolist()):
                first_seen.setdefault(value, lines[i])
        for idx in res.result.get("unexpected_index_list") or []:
            i = int(idx)
            if kind == "rule":
                out.append(
                    Finding(lines[i], rule_fields[column], severity, reasons[column][i] or "rule failed")
                )
            elif kind == "unique":
                first = first_seen[df[column].iat[i]]
                if first != lines[i]:  # GE lists every member of a duplicate group; report the repeats
                    out.append(
                        Finding(lines[i], column, severity, f"duplicate {column} (same text as line {first})")
                    )
            elif kind == "length":
                n = len(df[column].iat[i])
                out.append(
                    Finding(lines[i], column, severity, f"{n} characters (> {max_chars_warning}, unusual)")
                )
            elif kind == "type":
                out.append(
                    Finding(lines[i], column, severity, f"wrong type {type(df[column].iat[i]).__name__}")
                )
            else:
                out.append(Finding(lines[i], column, severity, "missing value"))
    return out


def _tolerated(
    res: Any, df: Any, reasons: dict[str, list[str | None]], field: str, column: str, fraction: float
) -> list[Finding]:
    """A ``mostly`` rule's rows: warnings when the share passed, else errors and one file-level error."""
    idx = [int(i) for i in res.result.get("unexpected_index_list") or []]
    if not idx:
        return []
    lines = df["line"].tolist()
    severity: Severity = "warning" if res.success else "error"
    out = [Finding(lines[i], field, severity, reasons[column][i] or "rule failed") for i in idx]
    if not res.success:
        n = len(df)
        out.append(
            Finding(
                None,
                field,
                "error",
                f"{len(idx)} of {n} rows ({len(idx) / n:.2%}) break rule {column.removeprefix('rule__')!r}, "
                f"more than validate.max_bad_row_fraction={fraction} tolerates (each row is listed)",
            )
        )
    return out


def _context_findings(
    parsed: list[ParsedLine], fmt: Format, budget: ContextBudget
) -> tuple[list[Finding], dict]:
    usable = [p for p in parsed if p.row is not None and not rule_problems(p.row, fmt)]
    lengths = sequence_lengths([p.row for p in usable if p.row is not None], fmt, budget.tokenizer)
    over = over_limit(lengths, budget.limit)
    findings = [
        Finding(
            usable[i].line,
            LENGTH_FIELD,
            "error",
            f"{lengths[i]} tokens (prompt + reference + EOS), more than the context of {budget.describe()}",
        )
        for i in over
    ]
    lines = [usable[i].line for i in over]
    summary = {"limit": budget.limit, "source": budget.source, "n_over": len(over), "lines": lines}
    return findings, summary


def validate_file(
    path: str | os.PathLike[str],
    fmt: Format,
    max_chars_warning: int = DEFAULT_MAX_CHARS_WARNING,
    max_bad_row_fraction: float = DEFAULT_MAX_BAD_ROW_FRACTION,
    budget: ContextBudget | None = None,
) -> ValidationReport:
    """Check a JSONL dataset in format ``fmt``; the report lists every finding (it never raises on bad content).

    With ``budget`` every row whose prompt + reference exceeds the context is an error, all of them reported.
    """
    if fmt not in RULES:
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(RULES)}")
    report = ValidationReport(path=str(path), fmt=fmt, n_rows=0)
    try:
        parsed = list(iter_lines(path, fmt))
    except DataError as exc:  # the file itself is missing
        report.findings.append(Finding(exc.line, exc.field, "error", exc.reason))
        return report
    report.n_rows = len(parsed)
    for p in parsed:
        report.findings.extend(Finding(p.line, pr.field, "error", pr.reason) for pr in p.problems)
    if not parsed:
        report.findings.append(
            Finding(None, None, "error", "no rows (the file is empty or holds only blank lines)")
        )
        return report
    if any(p.row is not None for p in parsed):
        df, reasons = _frame(parsed, fmt)
        report.findings.extend(_ge_findings(df, reasons, fmt, max_chars_warning, max_bad_row_fraction))
        if budget is not None:
            found, report.context = _context_findings(parsed, fmt, budget)
            report.findings.extend(found)
    report.findings.sort(key=lambda f: (f.line or 0, f.severity != "error", f.field or ""))
    return report


def write_report(report: ValidationReport, path: str | os.PathLike[str]) -> None:
    """The report as JSON, written atomically."""
    write_json(Path(path), report.to_dict())
