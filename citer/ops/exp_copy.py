"""A ``dvc exp run --temp`` (or ``--queue``) copy of the project: the user's own inputs linked in from the workspace.

DVC runs such an experiment in a copy under the workspace's ``.dvc/tmp/exps/`` that holds what git and DVC's cache
hold. Inputs that no stage writes and that live under git-ignored paths (your model directories with bootstrap off,
your data files with synth off) are in neither, so the copy would stop at its first stage with "not a directory".
:func:`link_workspace_inputs` links each such input that is missing in the copy and present in the workspace (``DVC_ROOT``,
which DVC sets to the workspace for an experiment's stages): files hard-linked (a directory as a tree of hard links),
so the copy reads the same bytes under the same project-relative name and records them as the workspace does, at no
disk cost; a symbolic link where hard links cannot be made (another file system). Nothing is written through them:
these inputs are read-only to the stages that read them, and every writer replaces a file by renaming a new one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from citer.ops.io import atomic_dir, atomic_path

EXPS_DIR = Path(".dvc") / "tmp" / "exps"


def workspace_of(root: Path) -> Path | None:
    """The workspace a DVC experiment's copy at ``root`` was made from, or None when ``root`` is no such copy."""
    ws = os.environ.get("DVC_ROOT")
    if not ws:
        return None
    workspace = Path(ws).resolve()
    if not root.resolve().is_relative_to(workspace / EXPS_DIR):
        return None
    return workspace


def _link(src: Path, dst: Path) -> None:
    """``dst`` as hard links to ``src`` (a file, or a directory's tree), else one symbolic link to it; made beside
    ``dst`` and renamed into place (:mod:`citer.ops.io`), so a failure leaves nothing half-linked."""
    if src.is_dir():
        with atomic_dir(dst) as tmp:
            try:
                shutil.copytree(src, tmp, copy_function=os.link, dirs_exist_ok=True)
            except OSError:
                shutil.rmtree(tmp)
                tmp.symlink_to(src.resolve(), target_is_directory=True)
    else:
        with atomic_path(dst) as tmp:
            tmp.unlink()  # the helper's empty placeholder: a link needs the name free
            try:
                os.link(src, tmp)
            except OSError:
                tmp.symlink_to(src.resolve())


def link_workspace_inputs(root: Path, refs: Iterable[str]) -> list[str]:
    """Link every project-relative ref of ``refs`` that is missing under ``root`` and present in the workspace the
    copy was made from; the refs linked (none outside an experiment's copy)."""
    workspace = workspace_of(root)
    if workspace is None:
        return []
    linked = []
    for ref in refs:
        rel = Path(ref)
        if rel.is_absolute() or ".." in rel.parts:
            continue  # the same path in the copy and the workspace, or outside both
        src, dst = workspace / rel, root / rel
        if dst.exists() or dst.is_symlink() or not src.exists():
            continue
        _link(src, dst)
        linked.append(ref)
    return linked
