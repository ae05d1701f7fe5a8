#!/usr/bin/env python3
"""Fail when the committed records are stale: ``dvc status`` on a clean checkout must name no stage whose code,
params, data or command changed since ``dvc.lock``, and no committed output edited since the run that wrote it.

    python scripts/check_records.py          # exit 0: the lock and reports are the committed code's; 1: stale

CI runs it first (``.ci/run``). Outputs a clean checkout does not have (models, label sets, the embedded data) do not
count: only what is in the checkout is compared with the lock. A dep that is missing counts unless some stage
writes it (a code file the lock names that is gone is a change too). Each stale stage is one line naming what
moved and the command that brings the records back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

MISSING = ("deleted", "not in cache")


def dvc_status(root: Path) -> dict[str, Any]:
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    res = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"dvc status failed in {root}: {(res.stderr or res.stdout).strip()[-2000:]}")
    return json.loads(res.stdout or "{}")


def stage_outputs(root: Path) -> set[str]:
    """Every path a stage of ``dvc.lock`` writes (as the lock names it, params interpolated)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text(encoding="utf-8")) or {}
    return {o["path"] for s in (lock.get("stages") or {}).values() for o in s.get("outs", [])}


def stale_stages(root: Path) -> dict[str, list[str]]:
    """``{stage: [what moved, ...]}`` for every stage whose committed record no longer matches the checkout."""
    written = stage_outputs(root)
    out: dict[str, list[str]] = {}
    for stage, changes in dvc_status(root).items():
        why: list[str] = []
        for change in changes if isinstance(changes, list) else [changes]:
            if isinstance(change, str):  # "changed command", "always changed"
                why.append(change)
                continue
            for kind, items in change.items():
                if not isinstance(items, dict):
                    why.append(kind)
                    continue
                for path, state in items.items():
                    if isinstance(state, dict):  # a params file: {"synth.n_train": "modified"}
                        why += [f"param {name} {how}" for name, how in state.items()]
                        continue
                    if kind == "changed outs" and state in MISSING:
                        continue  # an output a clean checkout does not hold
                    if kind == "changed deps" and state in MISSING and path in written:
                        continue  # an earlier stage's output, not in the checkout
                    why.append(f"{path} {state}")
        if why:
            out[stage] = sorted(set(why))
    return out


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    stale = stale_stages(root)
    for stage, why in sorted(stale.items()):
        shown = ", ".join(why[:4]) + (f" and {len(why) - 4} more" if len(why) > 4 else "")
        print(
            f"stale records: stage {stage} ({shown}): run `dvc repro {stage}` and commit dvc.lock, the reports "
            f"and `citer report docs` together",
            file=sys.stderr,
        )
    if not stale:
        print("records: dvc.lock and the committed reports come from this code, params and data")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
