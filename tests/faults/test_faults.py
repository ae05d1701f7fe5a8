"""The fault matrix: what a killed, concurrent, misconfigured or tampered ``citer`` command leaves behind, and whether
the next command ends in a consistent state. One test per fault (``-k`` picks some); the report, one command::

    python -m pytest -p no:xdist tests/faults --faults-report reports/faults.json [--faults-jobs N] [--basetemp DIR]

It builds one tiny finished project (the repository's tracked files without tests, shrunken params, one
``citer pipeline``), then copies it once per fault so faults never interfere, and runs the real ``citer`` command in
each copy as a subprocess, one torch thread each (``PREFECT_API_URL`` points at the session's Prefect server; one kill
starts its own on purpose):

- kill: SIGKILL ``citer eval sweep`` early (while it starts its own temporary Prefect server: no ``PREFECT_API_URL``),
  then the next sweep 4 s after it took the project lock, then the next one right after the registry gains a version
  (one copy, started without a champion, so the last killed sweep meant to move the alias), then a sweep to the end;
  SIGKILL ``citer route`` while it writes and ``citer router iterate`` while it retrains, then each again (the route
  rerun is the first of the two concurrent routes below). Checked: no process of the killed command (the Prefect
  server included) outlives it by more than 5 s; the alias points at an existing version whose files load (``citer route`` works);
  ``reports/promotion.json`` parses and names an existing version; no ``.tmp`` leftovers under reports/, artifacts/,
  outputs/; no promotion pending; a route output has exactly one row per input; every router directory loads.
- concurrent: two sweeps, the second started 1 s after the first holds the lock (it waits, then compares against
  the champion the first made; the alias, sampled every 0.1 s, never points at a version that lost), the same with
  ``lock.wait: false`` (the second refuses in one line naming the lock; the first succeeds), two ``citer route`` into
  one output, the second started 0.5 s after the first holds the lock (exactly N rows, the second skips them all).
- bad_params: out-of-range values each give exit 1, one ``error:`` line naming the key, no traceback, no file changed.
- corrupt: a truncated router file (``citer eval sweep``) and a truncated labels parquet (``citer router train``):
  one-line error naming the file, nothing promoted, nothing changed.
- tampered: a changed router.json in the MLflow artifact store (``citer route --llm-fraction 0.3`` over the
  pipeline's finished predictions must load the router: it refuses, naming sha256, and leaves the predictions as they
  were); a line that writes a marker file added to the stored pyfunc code (the three routes of the kill and
  concurrent route faults run in that copy: none runs it).
- registry: a dangling alias (the champion's version deleted through MlflowClient: sweep and route stop in one line,
  nothing promoted; deleting the alias tag as the message says leaves a consistent project without a champion), and
  ``registry.min_eval_examples`` above ``sweep.n_examples`` with no champion (not promoted, the reason naming the key;
  the same copy and sweep as the ``lock.wait: false`` fault).

Each entry: ``fault``, ``kind``, ``what_was_left`` (the state found right after the fault), ``recovered`` (the rerun or
next command ended in a consistent state: for a refusal, the refusal itself left the project consistent), ``ok`` (the
expected behaviour held), ``seconds`` and ``detail`` (the commands run with exit code, duration and stderr tail).
A fault's test fails when one of its entries is not ok or not recovered. Writes ``reports/faults.json`` in the base
project (and ``--faults-report PATH``, stamped in that checkout's ``reports/provenance.json``): ``{"faults": [...],
"totals": {"faults", "ok", "recovered"}}``. About 2.5 minutes on 2 idle cores with two faults at a time
(``--faults-jobs``; under 1 min of it the base project; most of a command's time is its imports and stores, so the
faults share commands where one command can show two of them); ``--basetemp DIR`` keeps the projects and logs.

Where it lives: ``fault_base.py`` (the base project), ``fault_harness.py`` (commands in a copy, report entries),
``fault_state.py`` (what a fault left), ``fault_procs.py`` (killing at a point, what outlived it),
``fault_cases_kill.py``, ``fault_cases_concurrent.py``, ``fault_cases_refused.py`` (the faults); this file runs them
and writes the report.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fault_base import build_base
from fault_cases_concurrent import fault_concurrent_sweeps, fault_nowait_and_min_eval, fault_routes
from fault_cases_kill import fault_kill_iterate, fault_kill_sweep
from fault_cases_refused import (
    fault_bad_params,
    fault_corrupt_labels,
    fault_corrupt_router,
    fault_dangling_alias,
    fault_tampered_router,
)
from fault_harness import Ctx, entry

from citer.ops.io import write_text

pytestmark = pytest.mark.slow

Fault = Callable[[Ctx], list[dict[str, Any]]]
KINDS = {"kill", "concurrent", "bad_params", "corrupt", "tampered", "registry"}
# Heaviest first, so two workers finish close together.
FAULTS: list[Fault] = [
    fault_kill_sweep,
    fault_concurrent_sweeps,
    fault_routes,
    fault_nowait_and_min_eval,
    fault_dangling_alias,
    fault_kill_iterate,
    fault_corrupt_router,
    fault_tampered_router,
    fault_corrupt_labels,
    fault_bad_params,
]
CASES = {f.__name__.removeprefix("fault_"): f for f in FAULTS}


def run_matrix(
    work: Path, api_url: str | None, jobs: int = 2, faults: list[Fault] = FAULTS
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Build the base project under ``work``, run ``faults`` (``jobs`` at a time) and write ``reports/faults.json`` in
    the base project; returns the report and each fault's entries."""
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    base = build_base(work / "base" / "project", api_url)
    built = time.monotonic() - t0
    ctx = Ctx(base, work, api_url)

    def one(fn: Fault) -> list[dict[str, Any]]:
        t = time.monotonic()
        try:
            return fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken fault is an entry, not the end of the report
            name = fn.__name__.removeprefix("fault_")
            # which lines of the fault broke, for whoever reads the report
            where = traceback.format_exc(limit=-4)[-3000:]
            return [
                entry(
                    name, "error", f"the fault itself failed: {exc!r}", False, False, t, None, traceback=where
                )
            ]

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        groups = list(pool.map(one, faults))
    entries = [e for group in groups for e in group]
    report = {
        "faults": entries,
        "totals": {
            "faults": len(entries),
            "ok": sum(e["ok"] for e in entries),
            "recovered": sum(e["recovered"] for e in entries),
        },
        "seconds": {"build": round(built, 1), "total": round(time.monotonic() - t0, 1)},
        "jobs": jobs,
    }
    write_text(base / "reports" / "faults.json", json.dumps(report, indent=2, default=str))
    return report, {f.__name__.removeprefix("fault_"): g for f, g in zip(faults, groups, strict=True)}


@pytest.fixture(scope="module")
def matrix(request, prefect_server, tmp_path_factory):
    """The faults whose tests were collected, run once together; the report also goes to ``--faults-report``."""
    from prefect.settings import PREFECT_API_URL

    chosen = {
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    faults = [f for name, f in CASES.items() if name in chosen]
    if not faults:
        pytest.skip("no fault selected")
    work = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CITER_ROOT", raising=False)
        report, by_case = run_matrix(
            work, str(PREFECT_API_URL.value()), request.config.getoption("faults_jobs"), faults
        )
    for e in report["faults"]:
        flag = "ok  " if e["ok"] else "FAIL"
        print(f"{flag} {e['kind']:<10} {e['fault']:<40} {e['seconds']:>6.1f}s  {e['what_was_left'][:150]}")
    if out := request.config.getoption("faults_report"):
        from citer.tracking.provenance import stamp_bench

        write_text(out, json.dumps(report, indent=2, default=str))
        stamp_bench(
            out, "faults", {"jobs": report["jobs"], "faults": sorted(chosen)}, report["seconds"]["total"]
        )
    return work, report, by_case


@pytest.mark.parametrize("case", CASES)
def test_fault(matrix, case):
    _, report, by_case = matrix
    entries = by_case[case]
    bad = [
        {k: e[k] for k in ("fault", "what_was_left", "recovered", "detail")}
        for e in entries
        if not (e["ok"] and e["recovered"])
    ]
    assert entries and not bad, (
        f"{len(bad)} of {len(entries)} entries did not hold ({report['seconds']}):\n"
        + json.dumps(bad, indent=1, default=str)[:8000]
    )


def test_the_matrix_covers_every_kind_once_per_name(matrix):
    work, report, by_case = matrix
    if set(by_case) != set(CASES):
        pytest.skip("only some faults ran (-k)")
    entries = report["faults"]
    assert {e["kind"] for e in entries} == KINDS, [(e["fault"], e["what_was_left"]) for e in entries]
    names = [e["fault"] for e in entries]
    assert len(names) == len(set(names)) == report["totals"]["faults"] >= 22, names
    written = json.loads((work / "base" / "project" / "reports" / "faults.json").read_text())
    assert written["totals"] == report["totals"]
