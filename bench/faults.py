"""A fault report: what a killed, concurrent, misconfigured or tampered ``citer`` command leaves behind, and whether the
next command ends in a consistent state. ``python bench/faults.py [--out PATH] [--jobs N] [--workdir DIR] [--keep]``.

It builds one tiny finished project (the repository's tracked files without tests, shrunken params, one
``citer pipeline``), then copies it once per fault so faults never interfere, and runs the real ``citer`` command in
each copy as a subprocess, one torch thread each (``PREFECT_API_URL`` points at one Prefect server the script starts,
unless set already):

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
Writes ``reports/faults.json`` in the base project (and ``--out``): ``{"faults": [...], "totals": {"faults", "ok",
"recovered"}}``; exits 1 when an entry is not ok. About 3 minutes on 2 idle cores with ``--jobs 2`` (under 1 min of it
the base project; most of a command's time is its imports and stores, so the faults share commands where one
command can show two of them); ``--base DIR --only NAME`` reruns single faults on a project kept by ``--keep``.

Where it lives: ``bench/fault_base.py`` (the base project), ``bench/fault_harness.py`` (commands in a copy, report
entries), ``bench/fault_state.py`` (what a fault left), ``bench/fault_procs.py`` (killing at a point, what outlived
it), ``bench/fault_cases_kill.py``, ``bench/fault_cases_concurrent.py``, ``bench/fault_cases_refused.py`` (the faults);
this file runs them and writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fault_base import build_base  # noqa: E402
from bench.fault_cases_concurrent import (  # noqa: E402
    fault_concurrent_sweeps,
    fault_nowait_and_min_eval,
    fault_routes,
)
from bench.fault_cases_kill import fault_kill_iterate, fault_kill_sweep  # noqa: E402
from bench.fault_cases_refused import (  # noqa: E402
    fault_bad_params,
    fault_corrupt_labels,
    fault_corrupt_router,
    fault_dangling_alias,
    fault_tampered_router,
)
from bench.fault_harness import Ctx, entry  # noqa: E402

# Heaviest first, so two workers finish close together.
FAULTS: list[Callable[[Ctx], list[dict[str, Any]]]] = [
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


def run_matrix(
    work: Path,
    api_url: str | None,
    jobs: int = 2,
    only: list[str] | None = None,
    base: Path | None = None,
) -> dict[str, Any]:
    """Build the base project under ``work`` (or reuse ``base``), run every fault (``jobs`` at a time) and write
    ``reports/faults.json`` in the base project; returns the report."""
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    if base is None:
        base = build_base(work / "base" / "project", api_url)
    built = time.monotonic() - t0
    ctx = Ctx(base, work, api_url)
    faults = [f for f in FAULTS if not only or any(o in f.__name__ for o in only)]

    def one(fn: Callable[[Ctx], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        t = time.monotonic()
        try:
            return fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken fault is an entry, not the end of the report
            name = fn.__name__.removeprefix("fault_")
            return [entry(name, "error", f"the fault itself failed: {exc!r}", False, False, t, None)]

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        entries = [e for group in pool.map(one, faults) for e in group]
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
    out = base / "reports" / "faults.json"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out)
    return report


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """``PREFECT_API_URL`` when set; else one temporary Prefect server for every command of the run."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also copy reports/faults.json here")
    ap.add_argument("--jobs", type=int, default=2, help="faults run at a time (default 2)")
    ap.add_argument("--workdir", type=Path, help="where the projects go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--only", help="comma-separated substrings of fault names")
    ap.add_argument(
        "--base", type=Path, help="a finished base project from an earlier --keep run (no rebuild)"
    )
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="citer-faults-"))
    try:
        with prefect_api() as url:
            only = args.only.split(",") if args.only else None
            report = run_matrix(work, url, args.jobs, only, base=args.base)
        for e in report["faults"]:
            flag = "ok  " if e["ok"] else "FAIL"
            print(
                f"{flag} {e['kind']:<10} {e['fault']:<40} {e['seconds']:>6.1f}s  {e['what_was_left'][:150]}"
            )
        print(json.dumps(report["totals"] | {"seconds": report["seconds"]}))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy((args.base or work / "base" / "project") / "reports" / "faults.json", args.out)
            from citer.tracking.provenance import stamp_bench

            stamp_bench(args.out, "faults", args, report["seconds"])
        return 0 if report["totals"]["ok"] == report["totals"]["faults"] else 1
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"projects kept in {work}")


if __name__ == "__main__":
    sys.exit(main())
