"""The concurrent faults: two sweeps at once (the second waits for the project lock, or with ``lock.wait: false``
refuses; the same sweep checks the ``registry.min_eval_examples`` gate), and three routes into one output in one copy
(a route killed while it writes, its rerun and a second route at once, the champion's stored pyfunc code tampered).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from fault_harness import BIG, N_BIG, Ctx, Proc, Proj, entry
from fault_procs import kill_when
from fault_state import (
    champion_artifacts,
    describe,
    leftovers,
    lock_held_by,
    output_rows,
    problems,
    promotion,
    registry,
)


class AliasWatch:
    """Every value the alias takes while two commands run (sampled every 0.1 s)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.values: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(sqlite3.Error):
                a = registry(self.root)["alias"]
                if not self.values or self.values[-1] != a:
                    self.values.append(a)
            self._stop.wait(0.1)

    def stop(self) -> list[str | None]:
        self._stop.set()
        self._thread.join()
        return self.values


def _second_after_lock(proj: Proj, first: Proc, args: tuple[str, ...], delay: float) -> Proc | None:
    """Start ``args`` ``delay`` s after ``first`` holds the project lock (None: it ended without taking it)."""
    while first.running() and not lock_held_by(proj.root, first.pid):
        time.sleep(0.05)
    time.sleep(delay)
    return proj.start(*args) if first.running() else None


def fault_concurrent_sweeps(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("concurrent_sweeps")
    proj.drop_champion()  # the first sweep promotes; the second must compare against that new champion
    watch = AliasWatch(proj.root)
    a = proj.start("eval", "sweep")
    b = _second_after_lock(proj, a, ("eval", "sweep"), 1.0)
    ra = proj.finish(a, 300)
    rb = proj.finish(b, 300) if b else None
    seen = watch.stop()
    ja, jb = ra.json(), rb.json() if rb else {}
    won = {str(j["version"]) for j in (ja, jb) if j.get("promoted") and j.get("version") is not None}
    reg = registry(proj.root)
    final = (
        str(jb["version"]) if jb.get("promoted") else (str(ja.get("version")) if ja.get("promoted") else None)
    )
    issues = []
    if rb is None or "waiting for the project lock" not in rb.err:
        issues.append("the second sweep did not wait for the lock")
    if ja.get("promoted") and str(jb.get("previous")) != str(ja.get("version")):
        issues.append(
            f"the second compared against {jb.get('previous')}, not the first's v{ja.get('version')}"
        )
    if any(v is not None and v not in won for v in seen):
        issues.append(f"the alias took a version that lost: {seen} (winners {sorted(won)})")
    if reg["alias"] != final:
        issues.append(f"alias v{reg['alias']} at the end, expected {final}")
    state = problems(proj.root)
    recovered = ra.rc == 0 and rb is not None and rb.rc == 0 and not state
    left = (
        f"first: v{ja.get('version')} promoted={ja.get('promoted')}; second: v{jb.get('version')} "
        f"promoted={jb.get('promoted')} (previous {jb.get('previous')}); alias seen {seen}; {describe(proj.root)}"
    )
    return [
        entry(
            "concurrent_sweeps_wait",
            "concurrent",
            left,
            recovered,
            recovered and not issues,
            t0,
            proj,
            issues=issues,
            problems=state,
            second_reason=jb.get("reason"),
        )
    ]


def fault_nowait_and_min_eval(ctx: Ctx) -> list[dict[str, Any]]:
    """Two faults, one sweep: with ``lock.wait: false`` a second sweep refuses while the first runs; the first, with
    no champion and ``registry.min_eval_examples`` above ``sweep.n_examples``, must not promote."""
    t0 = time.monotonic()
    proj = ctx.copy("nowait_min_eval")
    proj.set_param("lock.wait", False)
    proj.drop_champion()  # with no champion the gate is the only thing that can keep the candidate out
    proj.set_param("registry.min_eval_examples", 100)  # sweep.n_examples is 12
    a = proj.start("eval", "sweep")
    b = _second_after_lock(proj, a, ("eval", "sweep"), 1.0)
    rb = proj.finish(b, 120) if b else None
    ra = proj.finish(a, 300)
    refused = rb is not None and rb.one_line_error("lock")
    state = problems(proj.root)
    recovered = ra.rc == 0 and not state
    left = (
        f"second: rc {rb.rc if rb else None} {rb.error_lines[:1] if rb else ''}; first: rc {ra.rc}; "
        f"{describe(proj.root)}"
    )
    nowait = entry(
        "concurrent_sweeps_nowait",
        "concurrent",
        left,
        recovered,
        recovered and refused,
        t0,
        proj,
        problems=state,
    )
    rec, reg = promotion(proj.root) or {}, registry(proj.root)
    held = rec.get("promoted") == 0 and "min_eval_examples" in str(rec.get("reason")) and reg["alias"] is None
    left = f"promoted={rec.get('promoted')}, reason: {str(rec.get('reason'))[:160]}; alias {reg['alias']}"
    gate = entry(
        "min_eval_examples", "registry", left, recovered, recovered and held, t0, proj, problems=state
    )
    return [nowait, gate]


def fault_routes(ctx: Ctx) -> list[dict[str, Any]]:
    """Three faults, one copy and three routes into one output: the champion's stored pyfunc code gains a line that
    writes a marker file (no route may run it); a route is killed while it writes; the rerun resumes it while a
    second route into the same output starts 0.5 s after the first holds the lock (it waits, then skips every row)."""
    t0 = time.monotonic()
    proj = ctx.copy("routes")
    # Batches of 2, so the output grows in chunks of 8 rows (CHUNK_BATCHES x 2) and the kill below lands after the
    # first with four to go: at 8 (chunks of 32 and 8) a fast machine wrote the last chunk between two polls.
    proj.set_param("inference.batch_size", 2)
    marker = proj.root / "PYFUNC_CODE_RAN"
    code = sorted(p for p in champion_artifacts(proj).rglob("*.py"))
    line = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('the stored pyfunc code ran')\n"
    for f in code:
        f.write_text(line + f.read_text())
    out = proj.root / "outputs" / "faults_route.jsonl"
    args = ("route", "--input", BIG, "--output", str(out.relative_to(proj.root)))
    proc = proj.start(*args)
    kill = kill_when(proj, proc, lambda _w: len(output_rows(out)[0]) >= 8, timeout=150)
    rows, torn = output_rows(out)
    left = f"killed at {kill.at_s} s: {len(rows)} of {N_BIG} rows" + (", a torn last line" if torn else "")
    left += f", {len(leftovers(proj.root))} leftover(s); {kill.text()}"
    a = proj.start(*args)  # the rerun, resuming
    b = _second_after_lock(proj, a, args, 0.5)
    ra, rb = proj.finish(a, 240), proj.finish(b, 240) if b else None
    after, torn_after = output_rows(out)
    exact = after == list(range(N_BIG)) and not torn_after and not leftovers(proj.root)
    recovered = ra.rc == 0 and exact
    both = recovered and rb is not None and rb.rc == 0 and rb.json().get("n_skipped") == N_BIG
    ran = marker.exists()
    common = {"rows_after": len(after), "unique_indices": len(set(after)), "torn_after": torn_after}
    return [
        entry(
            "kill_route",
            "kill",
            left,
            recovered,
            kill.fired and 0 < len(rows) < N_BIG and not kill.survivors and recovered,
            t0,
            proj,
            rows_at_kill=len(rows),
            n_skipped_by_rerun=ra.json().get("n_skipped"),
            survivors=kill.survivors,
            **common,
        ),
        entry(
            "concurrent_routes",
            "concurrent",
            f"{len(after)} rows for {N_BIG} inputs ({len(set(after))} distinct), torn={torn_after}; second: "
            + (
                f"rc {rb.rc}, n_skipped {rb.json().get('n_skipped')}"
                if rb
                else "not started (the first ended)"
            ),
            both,
            both,
            t0,
            proj,
            second_started_while_first_ran=b is not None,
            **common,
        ),
        entry(
            "tampered_pyfunc_code",
            "tampered",
            f"{len(proj.cmds)} routes loaded the champion, marker written={ran}, {len(after)} rows routed",
            recovered,
            bool(code) and not ran and recovered,
            t0,
            proj,
            tampered=[str(f.relative_to(proj.root)) for f in code],
            note="router_sha256 covers router.safetensors and router.json only; citer's loads never import the "
            "stored code (mlflow.pyfunc.load_model of the registry model would)",
        ),
    ]
