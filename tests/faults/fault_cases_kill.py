"""The kill faults: ``citer eval sweep`` killed three times in a row (while its own Prefect server starts, mid-way
through the locked stage, right after the registry gained a version), then run to the end; ``citer router iterate``
killed while it retrains, then run again. (The killed route is one of fault_cases_concurrent.py's routes.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fault_harness import Ctx, Proc, entry
from fault_procs import Kill, TreeWatch, kill_when
from fault_state import (
    changed,
    describe,
    files_state,
    leftovers,
    lock_held_by,
    problems,
    promotion,
    registry,
    route_works,
    routers_load,
    walk,
)

MID_S = 4.0  # the mid-sweep kill, this long after the sweep took the project lock (the locked part: ~15 s)


def fault_kill_sweep(ctx: Ctx) -> list[dict[str, Any]]:
    """Three kills of ``citer eval sweep`` in a row in one copy (each next sweep starts where the last kill left the
    project), then one sweep to the end and a route with the champion. The copy starts without a champion, so the
    last killed sweep meant to move the alias."""
    t0 = time.monotonic()
    proj = ctx.copy("kill_sweep")
    proj.drop_champion()
    kills: list[tuple[str, str, Kill, str]] = []

    def server(proc: Proc) -> Callable[[TreeWatch], bool]:  # its own temporary Prefect server started, + 1 s
        seen: list[float] = []

        def point(watch: TreeWatch) -> bool:
            if not seen and watch.matching("uvicorn"):
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= 1.0

        return point

    def mid(
        proc: Proc,
    ) -> Callable[[TreeWatch], bool]:  # MID_S into the locked stage: routers, champion, decoding
        held: list[float] = []

        def point(_w: TreeWatch) -> bool:
            if not held and lock_held_by(proj.root, proc.pid):
                held.append(time.monotonic())
            return bool(held) and time.monotonic() - held[0] >= MID_S

        return point

    def registered(proc: Proc) -> Callable[[TreeWatch], bool]:  # the registry gained a version
        n0 = len(registry(proj.root)["versions"])
        return lambda _w: len(registry(proj.root)["versions"]) > n0

    steps = [
        (
            "kill_sweep_own_server",
            "its own Prefect server starting (+1 s), no PREFECT_API_URL",
            server,
            False,
        ),
        ("kill_sweep_mid", f"project lock held + {MID_S:g} s", mid, True),
        ("kill_sweep_after_register", "the registry gained a version", registered, True),
    ]
    for name, where, make, api in steps:
        proc = proj.start("eval", "sweep", api=api)
        kill = kill_when(proj, proc, make(proc), timeout=180)
        kills.append((name, where, kill, f"killed at {kill.at_s} s: {describe(proj.root)}; {kill.text()}"))
    after_kill = registry(proj.root)
    rerun = proj.run("eval", "sweep", timeout=300)
    state = problems(proj.root)
    routes, _ = route_works(proj, "kill_sweep")
    reg, rec = registry(proj.root), promotion(proj.root) or {}
    recovered = rerun.rc == 0 and not state and routes and reg["alias"] is not None
    expect = []
    if (
        len(after_kill["versions"]) > 1
    ):  # the last kill came after registering: the rerun completes its decision
        killed_v = max(after_kill["versions"], key=int)
        rerun_v = str(rec.get("version"))
        if not (reg["alias"] == killed_v or (rec.get("promoted") and reg["alias"] == rerun_v)):
            expect.append(
                f"alias {reg['alias']}, expected v{killed_v} (the killed sweep's decision) or v{rerun_v}"
            )
        if str(rec.get("previous")) != killed_v:
            expect.append(f"the rerun compared against {rec.get('previous')}, not the recovered v{killed_v}")
    out = []
    for name, where, kill, left in kills:
        extra = []
        if name == "kill_sweep_own_server" and not kill.seen:
            extra.append("no temporary Prefect server was seen")
        issues = extra + (expect if name == "kill_sweep_after_register" else [])
        ok = kill.fired and not kill.survivors and recovered and not issues
        out.append(
            entry(
                name,
                "kill",
                left,
                recovered,
                ok,
                t0,
                proj,
                fault_point=where,
                fault_point_reached=kill.fired,
                descendants_seen=kill.seen,
                survivors=kill.survivors,
                after_rerun=describe(proj.root),
                problems=state,
                route_works=routes,
                unexpected=issues,
                note="the three kills run one after another in one copy; recovered: the final rerun",
            )
        )
    return out


def fault_kill_iterate(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("kill_iterate")
    proj.set_param("router.lr", 0.002)  # every router retrains (labels after iteration 1 follow their router)
    routers = proj.root / "artifacts"
    before = files_state(proj.root, ("artifacts",))
    proc = proj.start("router", "iterate")

    def point(_w: TreeWatch) -> bool:  # an atomic writer is mid-write, or a router was already replaced
        if any(p.name.startswith(".") and p.name.endswith(".tmp") for p in walk(routers)):
            return True
        return any(
            files_state(proj.root, ("artifacts",)).get(k) != v
            for k, v in before.items()
            if k.endswith("router.json")
        )

    kill = kill_when(proj, proc, point, timeout=150)
    now = files_state(proj.root, ("artifacts",))
    left = (
        f"killed at {kill.at_s} s: {len(changed(before, now))} artifact file(s) changed, leftovers "
        f"{leftovers(proj.root)}; {kill.text()}"
    )
    rerun = proj.run("router", "iterate", timeout=240)
    bad = routers_load(proj.root)
    incomplete = [
        str(d.relative_to(proj.root))
        for d in (routers / "routers").iterdir()
        if d.is_dir() and not {"router.json", "router.safetensors"} <= {f.name for f in d.iterdir()}
    ]
    recovered = rerun.rc == 0 and not bad and not incomplete and not leftovers(proj.root)
    ok = kill.fired and not kill.survivors and recovered
    return [
        entry(
            "kill_router_iterate",
            "kill",
            left,
            recovered,
            ok,
            t0,
            proj,
            routers_not_loading=bad,
            incomplete_dirs=incomplete,
            rerun_said=rerun.out.strip().splitlines()[-6:],
            survivors=kill.survivors,
        )
    ]
