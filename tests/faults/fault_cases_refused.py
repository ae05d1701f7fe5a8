"""The faults a command must refuse in one ``error:`` line, changing nothing: bad params, a corrupt router file or
labels parquet, a tampered router.json in the artifact store, a dangling registry alias.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fault_harness import ALIAS, MODEL, SMALL, Cmd, Ctx, Proj, entry
from fault_state import (
    PENDING,
    champion_artifacts,
    changed,
    describe,
    files_state,
    leftovers,
    problems,
    registry,
)

# (key, value, command): each must fail before any work, in one line naming the key.
BAD_PARAMS: list[tuple[str, Any, list[str]]] = [
    ("router.epochs", -1, ["router", "train", "--iteration", "1"]),
    ("router.lr", 0, ["router", "iterate"]),
    ("router.batch_size", 0, ["router", "train", "--iteration", "1"]),
    ("router.dropout", 1.5, ["router", "iterate"]),
    ("models.device", "tpu9", ["route"]),
    ("eval.n_examples", -298, ["eval", "models"]),
    ("sweep.rule.accuracy_ratio", -1, ["eval", "sweep"]),
    ("registry.min_eval_examples", 0, ["eval", "sweep"]),
]


def fault_bad_params(ctx: Ctx) -> list[dict[str, Any]]:
    proj = ctx.copy("bad_params")
    original = (proj.root / "params.yaml").read_text()
    before, reg0 = files_state(proj.root), registry(proj.root)
    out = []
    for key, value, args in BAD_PARAMS:
        t0 = time.monotonic()
        proj.cmds = []
        proj.set_param(key, value)
        cmd = proj.run(*args, timeout=60)
        (proj.root / "params.yaml").write_text(original)
        touched = changed(before, files_state(proj.root))
        same_registry = registry(proj.root) == reg0
        one = cmd.one_line_error(key)
        stray = [line for line in cmd.err.splitlines() if line.strip() and not line.startswith("error:")]
        recovered = not touched and same_registry and not problems(proj.root)
        left = f"rc {cmd.rc}, {len(cmd.error_lines)} error line(s), {len(touched)} file(s) changed"
        out.append(
            entry(
                f"bad_param {key}={value}",
                "bad_params",
                left,
                recovered,
                one and recovered,
                t0,
                proj,
                error=cmd.error_lines,
                other_stderr=stray[:3],
                changed=touched,
            )
        )
    return out


def _refusal(
    proj: Proj, cmd: Cmd, before: dict[str, Any], reg0: dict[str, Any], *needles: str
) -> dict[str, Any]:
    """What a refused command left: the checks shared by the corrupt, tampered and registry faults. ``changed``:
    files that existed before and differ or are gone; ``created``: new files (noted, not a failure)."""
    after = files_state(proj.root)
    reg = registry(proj.root)
    return {
        "one_line": cmd.one_line_error(*needles),
        "error": cmd.error_lines,
        "changed": [k for k in changed(before, after) if k in before],
        "created": sorted(after.keys() - before.keys()),
        "new_versions": sorted(set(reg["versions"]) - set(reg0["versions"])),
        "alias_moved": reg["alias"] != reg0["alias"],
        "pending": (proj.root / PENDING).exists(),
        "leftovers": leftovers(proj.root),
    }


def _clean(r: dict[str, Any], allow_changes: bool = False) -> bool:
    return (
        (allow_changes or not r["changed"])
        and not r["new_versions"]
        and not r["alias_moved"]
        and not r["pending"]
        and not r["leftovers"]
    )


def _corrupt(ctx: Ctx, fault: str, rel: str, *args: str) -> list[dict[str, Any]]:
    """Truncate the file ``rel`` to half its size, run ``citer *args``: one line naming the file, nothing changed."""
    t0 = time.monotonic()
    proj = ctx.copy(fault)
    f = proj.root / rel
    with f.open("r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    before, reg0 = files_state(proj.root), registry(proj.root)
    cmd = proj.run(*args, timeout=180)
    r = _refusal(proj, cmd, before, reg0, f.name)
    recovered = _clean(r) and not problems(proj.root)
    left = f"rc {cmd.rc}, {r['error'][:1]}, new versions {r['new_versions']}, {len(r['changed'])} file(s) changed"
    return [
        entry(fault, "corrupt", left, recovered, r["one_line"] and recovered, t0, proj, truncated=rel, **r)
    ]


def fault_corrupt_router(ctx: Ctx) -> list[dict[str, Any]]:
    return _corrupt(ctx, "corrupt_router_file", "artifacts/routers/iter2/router.safetensors", "eval", "sweep")


def fault_corrupt_labels(ctx: Ctx) -> list[dict[str, Any]]:
    rel = "artifacts/labels/iter2/tokens.parquet"
    return _corrupt(ctx, "corrupt_labels_parquet", rel, "router", "train", "--iteration", "2")


def fault_tampered_router(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("tampered_router")
    files = sorted(champion_artifacts(proj).rglob("router.json"))
    meta = json.loads(files[0].read_text())
    meta["dropout"] = float(meta.get("dropout", 0.1)) + 0.01
    files[0].write_text(json.dumps(meta, indent=2))
    before, reg0 = files_state(proj.root), registry(proj.root)
    # The pipeline's own output, finished with the champion's τ: another τ makes the route decode it again, so it
    # must load (and check) the router; the refusal must leave the finished predictions as they were.
    cmd = proj.run("route", "--llm-fraction", "0.3", timeout=150)
    r = _refusal(proj, cmd, before, reg0, "sha256")
    recovered = _clean(r) and not problems(proj.root)
    left = f"rc {cmd.rc}, {r['error'][:1]}, changed {r['changed']}"
    return [
        entry(
            "tampered_router_json",
            "tampered",
            left,
            recovered,
            r["one_line"] and recovered,
            t0,
            proj,
            tampered=str(files[0].relative_to(proj.root)),
            **r,
        )
    ]


def fault_dangling_alias(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("dangling_alias")
    champion = registry(proj.root)["alias"]
    proj.client().delete_model_version(MODEL, champion)
    before, reg0 = files_state(proj.root), registry(proj.root)
    sweep = proj.run("eval", "sweep", timeout=180)
    r_sweep = _refusal(proj, sweep, before, reg0, "alias")
    route = proj.run("route", "--input", SMALL, "--output", "outputs/dangling.jsonl", timeout=150)
    r_route = _refusal(proj, route, before, reg0, "alias")
    left = (
        f"v{champion} deleted: sweep rc {sweep.rc} {r_sweep['error'][:1]}; route rc {route.rc}; "
        f"new versions {r_sweep['new_versions']}; {describe(proj.root)}"
    )
    # The way out the message names: delete citer's alias tag; the project is then consistent, with no champion.
    proj.client().delete_registered_model_tag(MODEL, f"citer.alias.{ALIAS}")
    # promotion.json still names the deleted version until the next sweep rewrites it: part of the fault itself.
    state = [p for p in problems(proj.root) if not p.startswith("promotion.json names")]
    recovered = not state and _clean(r_sweep) and _clean(r_route)
    ok = r_sweep["one_line"] and _clean(r_sweep) and r_route["one_line"] and _clean(r_route) and recovered
    return [
        entry(
            "dangling_alias",
            "registry",
            left,
            recovered,
            ok,
            t0,
            proj,
            sweep=r_sweep,
            route=r_route,
            after_recovery=describe(proj.root),
            problems=state,
        )
    ]
