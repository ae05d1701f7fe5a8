"""The project's own MLflow store and the client every registry call goes through.

Portability: citer records models and files relative to the project root (:meth:`citer.project.Project.portable_ref`).
MLflow itself cannot: ``create_experiment`` makes a relative artifact location absolute against the current
directory, and every run, logged model and model version copies that absolute prefix. So a project's own sqlite store
is *rebased* when it is opened (:func:`open_store`): when its experiments point at ``<old root>/<mlflow_artifacts>``
and the project now lives elsewhere (copied or moved), every stored ``<old root>/`` prefix becomes the new root and the
file is vacuumed, so the copy logs into, and loads from, its own ``mlartifacts``.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from citer.project import Project


class RegistryError(ValueError):
    """A registry state the user must fix (no champion yet, models gone); the message says how."""


def _own_sqlite(proj: Project) -> Path | None:
    """The project's sqlite store file when it lies inside the project (a store shared from outside is left alone)."""
    uri = proj.tracking_uri
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///") :])
    try:
        db.resolve().relative_to(proj.root.resolve())
    except ValueError:
        return None
    return db if db.is_file() else None


def _local_path(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def _text_columns(con: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = con.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
        "AND sql NOT LIKE 'CREATE VIRTUAL%'"
    ).fetchall()
    out = []
    for (table,) in tables:
        for _, col, typ, *_ in con.execute(f'PRAGMA table_info("{table}")'):
            if any(t in (typ or "").upper() for t in ("CHAR", "TEXT", "CLOB")):
                out.append((table, col))
    return out


def _substitute(old: str, new: str) -> Any:
    """A replacer of the path prefix ``old``: not preceded by a path character, followed by a separator, a quote or
    the end. Inside a ``file://`` URI the root is percent-encoded (a space is %20), elsewhere it is plain."""
    forms = sorted({re.escape(old), re.escape(quote(old))}, key=len, reverse=True)
    pat = re.compile(r"(?<![\w.~%-])(file://)?(" + "|".join(forms) + r")(?=/|$|\"|')")

    def sub(value: str | None) -> str | None:
        if value is None:
            return None
        return pat.sub(lambda m: m.group(1) + quote(new) if m.group(1) else new, value)

    return sub


def rebase_store(db: str | Path, root: Path, artifacts: str) -> list[str]:
    """Rewrite a copied project's store onto ``root``; returns the old roots replaced (none: nothing to do).

    An old root is the directory above ``artifacts`` (params ``paths.mlflow_artifacts``) in an experiment's artifact
    location, when it is not ``root``. Only whole path prefixes are replaced (``/a/proj/`` never touches
    ``/a/proj2/``), in every text column, so no stored string keeps naming the original.
    """
    rel = Path(artifacts)
    if rel.is_absolute():
        return []
    new_root = str(root.resolve())
    con = sqlite3.connect(str(db))
    try:
        olds = set()
        for (loc,) in con.execute("SELECT artifact_location FROM experiments"):
            path = Path(unquote(_local_path(loc or "")))
            if path.is_absolute() and path.parts[-len(rel.parts) :] == rel.parts:
                old = str(path.parents[len(rel.parts) - 1])
                if old != new_root and len(old) > 1:
                    olds.add(old)
        if not olds:
            return []
        for old in sorted(olds, key=len, reverse=True):
            con.create_function("citer_rebase", 1, _substitute(old, new_root))
            with con:
                for table, col in _text_columns(con):
                    con.execute(
                        f'UPDATE "{table}" SET "{col}" = citer_rebase("{col}") '
                        f'WHERE instr("{col}", ?) > 0 OR instr("{col}", ?) > 0',
                        (old, quote(old)),
                    )
        con.execute("VACUUM")  # else the old strings stay readable in freed pages
        return sorted(olds)
    finally:
        con.close()


def open_store(proj: Project) -> str:
    """The project's tracking URI, its own sqlite store first rebased onto this root (see the module docstring)."""
    db = _own_sqlite(proj)
    if db is not None:
        rebase_store(db, proj.root, proj.params.paths.mlflow_artifacts)
    return proj.tracking_uri


@dataclass(frozen=True)
class RouterVersion:
    name: str
    version: str
    tags: dict[str, str]
    source: str

    @property
    def tau(self) -> float:
        return float(self.tags["tau"])

    @property
    def verify_kwargs(self) -> dict[str, float | int | bool]:
        """The verification its point was chosen with (:mod:`citer.decoding.verify`), as engine keyword arguments;
        a version registered without one is plain CITER."""
        from citer.decoding.verify import Verification

        return Verification.from_tags(self.tags).engine_kwargs()


def _client(tracking_uri: str | None = None):
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    return mlflow.MlflowClient()
