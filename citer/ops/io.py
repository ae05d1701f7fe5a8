"""Atomic artifact writing: everything goes to a temporary sibling first and is renamed into place.

A stage killed half-way therefore leaves either the previous artifact or none, never a truncated one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; on success it replaces ``path`` in one rename."""
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, dst)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` (old contents removed)."""
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def file_digest(path: str | os.PathLike[str], algorithm: str = "sha256") -> str:
    """Hex digest of a file read in 1 MiB blocks (``md5`` is what DVC records for a file)."""
    h = hashlib.new(algorithm)
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_artifact_meta(
    directory: str | os.PathLike[str],
    files: Iterable[str],
    meta_file: str,
    error: type[ValueError],
    written_by: str,
) -> dict[str, Any]:
    """The JSON meta of an artifact directory, after checking every expected file is there; ``error`` names the file."""
    d = Path(directory)
    for name in files:
        if not (d / name).is_file():
            raise error(f"{d / name}: missing (not a directory written by {written_by})")
    try:
        return json.loads((d / meta_file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{d / meta_file}: not valid JSON ({exc})") from exc


def read_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
