"""What a fault left in a project copy, read straight from its files and its MLflow sqlite store: the registry,
``reports/promotion.json``, a pending promotion, atomic writers' leftovers, route outputs, routers that load, the
project lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from fault_harness import ALIAS, MODEL, SMALL, Cmd, Proj

PENDING = ".state/promotion_pending.json"
OWNED = ("reports", "artifacts", "outputs")


def registry(root: Path) -> dict[str, Any]:
    """The registry read straight from the project's sqlite store: versions (version -> run id), the alias, citer's
    alias tag and retired versions."""
    db = root / "mlflow.db"
    # A read-only connection fails ("locked") while a writer holds the store, and ("readonly database") when a
    # killed writer left a hot journal; keep trying for up to ~30 s, rolling a hot journal back as a client would.
    for attempt in range(150):
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                versions = {
                    str(v): r
                    for v, r in con.execute(
                        "select version, run_id from model_versions where name=?", (MODEL,)
                    )
                }
                alias = con.execute(
                    "select version from registered_model_aliases where name=? and alias=?", (MODEL, ALIAS)
                ).fetchone()
                tag = con.execute(
                    "select value from registered_model_tags where name=? and key=?",
                    (MODEL, f"citer.alias.{ALIAS}"),
                ).fetchone()
                retired = [
                    str(v)
                    for (v,) in con.execute(
                        "select version from model_version_tags where name=? and key='citer.retired'",
                        (MODEL,),
                    )
                ]
                locations = dict(
                    (str(v), loc)
                    for v, loc in con.execute(
                        "select version, storage_location from model_versions where name=?", (MODEL,)
                    )
                )
            finally:
                con.close()
            return {
                "versions": versions,
                "alias": str(alias[0]) if alias else None,
                "alias_tag": tag[0] if tag else None,
                "retired": retired,
                "locations": locations,
            }
        except sqlite3.OperationalError as exc:
            if attempt == 149:
                raise
            if "readonly" in str(exc):
                # A writer killed mid-transaction leaves a hot journal that only a read-write connection may roll
                # back (as the next citer command would): open one, read nothing, close.
                rw = sqlite3.connect(db, timeout=5)
                try:
                    rw.execute("select count(*) from sqlite_master").fetchone()
                finally:
                    rw.close()
            time.sleep(0.05 if attempt < 40 else 0.25)
    raise AssertionError("unreachable")


def walk(base: Path) -> list[Path]:
    """Every file and directory under ``base``, read while a command may be renaming or removing them: what vanishes
    mid-walk is left out (``Path.rglob`` raises when a directory it is about to list was just renamed away)."""
    out = []
    for top, dirs, files in os.walk(base, onerror=_only_vanished):
        out += [Path(top) / n for n in dirs + files]
    return sorted(out)


def _only_vanished(err: OSError) -> None:
    """os.walk's error handler: a directory that vanished before it was listed is skipped, any other error raised."""
    if not isinstance(err, FileNotFoundError):
        raise err


def leftovers(root: Path) -> list[str]:
    """What killed atomic writers leave: ``.{name}.*.tmp`` and ``.{name}.old-{pid}`` under the owned directories."""
    out = []
    for d in OWNED:
        base = root / d
        if base.is_dir():
            out += [
                str(p.relative_to(root))
                for p in walk(base)
                if p.name.startswith(".") and (p.name.endswith(".tmp") or ".old-" in p.name)
            ]
    return sorted(out)


def promotion(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / "reports" / "promotion.json").read_text())
    except (OSError, ValueError):
        return None


def problems(root: Path) -> list[str]:
    """Why the project is not in a consistent state (empty: consistent)."""
    out = []
    reg = registry(root)
    if left := leftovers(root):
        out.append(f"leftovers {left}")
    if (root / PENDING).exists():
        out.append(f"{PENDING} still there")
    if reg["alias"] is not None and reg["alias"] not in reg["versions"]:
        out.append(f"alias -> v{reg['alias']}, which does not exist")
    if reg["alias_tag"] is not None and reg["alias"] != reg["alias_tag"]:
        out.append(f"citer's alias tag says v{reg['alias_tag']}, the alias is {reg['alias']}")
    if reg["alias"] is not None and reg["alias"] in reg["retired"]:
        out.append(f"alias -> v{reg['alias']}, which is retired")
    rec = promotion(root)
    if rec is None:
        out.append("reports/promotion.json missing or not JSON")
    elif rec.get("version") is not None and str(rec["version"]) not in reg["versions"]:
        out.append(f"promotion.json names v{rec['version']}, which does not exist")
    return out


def files_state(root: Path, dirs: tuple[str, ...] = OWNED) -> dict[str, tuple[int, int, str]]:
    """Every file under ``dirs``: (size, mtime_ns, sha256), to tell whether a command changed anything. A file renamed
    or removed between listing and reading (a running command's atomic writer) is left out."""
    out = {}
    for d in dirs:
        for p in walk(root / d):
            try:
                if p.is_file():
                    st = p.stat()
                    out[str(p.relative_to(root))] = (
                        st.st_size,
                        st.st_mtime_ns,
                        hashlib.sha256(p.read_bytes()).hexdigest(),
                    )
            except FileNotFoundError:
                continue
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def describe(root: Path) -> str:
    """The state in one line: registry, promotion.json, pending intent, leftovers."""
    reg = registry(root)
    rec = promotion(root)
    rec_text = "unreadable" if rec is None else f"v{rec.get('version')} promoted={rec.get('promoted')}"
    parts = [
        f"versions {sorted(reg['versions'], key=int)}",
        f"alias {'v' + reg['alias'] if reg['alias'] else 'none'}",
        f"promotion.json {rec_text}",
    ]
    if reg["retired"]:
        parts.append(f"retired {reg['retired']}")
    if (root / PENDING).exists():
        parts.append("promotion pending")
    left = leftovers(root)
    parts.append(f"{len(left)} leftover(s)" + (f" {left[:3]}" if left else ""))
    return ", ".join(parts)


def output_rows(path: Path) -> tuple[list[int], bool]:
    """Indices of the rows in a route output, and whether its last line is torn."""
    if not path.exists():
        return [], False
    data = path.read_bytes()
    idx, torn = [], bool(data) and not data.endswith(b"\n")
    for line in data.splitlines()[: -1 if torn else None]:
        try:
            idx.append(int(json.loads(line)["index"]))
        except (ValueError, KeyError, TypeError):
            torn = True
    return idx, torn


def route_works(proj: Proj, name: str) -> tuple[bool, Cmd]:
    """``citer route`` with the champion on two questions into a fresh output."""
    out = f"outputs/check_{name}.jsonl"
    cmd = proj.run("route", "--input", SMALL, "--output", out, timeout=150)
    rows, _ = output_rows(proj.root / out)
    return cmd.rc == 0 and rows == [0, 1], cmd


def routers_load(root: Path) -> list[str]:
    """Router directories that do not load (``citer.routing.mlp.load_router``)."""
    from citer.routing.mlp import load_router

    bad = []
    for d in sorted((root / "artifacts" / "routers").iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            try:
                load_router(d)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                bad.append(f"{d.name}: {type(exc).__name__}: {str(exc)[:120]}")
    return bad


def lock_held_by(root: Path, pid: int) -> bool:
    """Whether ``pid`` holds the project lock (``.state/project.lock.json``)."""
    try:
        return json.loads((root / ".state" / "project.lock.json").read_text())["pid"] == pid
    except (OSError, ValueError, KeyError):
        return False


def champion_artifacts(proj: Proj) -> Path:
    """The champion's model directory in this copy's artifact store (``mlartifacts/models/m-.../artifacts``)."""
    reg = registry(proj.root)
    loc = reg["locations"][reg["alias"]]
    rel = loc[loc.index("mlartifacts/") :]
    return proj.root / rel
