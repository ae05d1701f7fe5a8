"""Where a dataset row came from: its file and 1-based line, carried beside the row and never inside it.

:func:`citer.data.jsonl.read_jsonl` returns :class:`Row` objects. A Row is the plain dict of the JSON object (same
keys, ``==``, ``json.dumps`` and ``dict(row)`` see nothing else), so prompts, hashes of examples and every file that
rows are written back to stay exactly what they were; only error messages read the provenance, via :func:`origin`.
Keeping it out of the keys matters: a path inside the row would change example hashes when a project moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Row(dict[str, Any]):
    """A row of a dataset file; ``path`` and ``line`` (1-based, blank lines counted) say where it was read."""

    __slots__ = ("line", "path")

    def __init__(self, data: Mapping[str, Any], path: str, line: int) -> None:
        super().__init__(data)
        self.path = path
        self.line = line

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies (copy.copy, Prefect's input hashing) keep the provenance.
        return (Row, (dict(self), self.path, self.line))


def origin(row: Mapping[str, Any], index: int | None = None) -> str:
    """``"path:line"`` of a row read from a file; else ``"row N"`` (1-based ``index + 1``) for rows built in code."""
    if isinstance(row, Row):
        return f"{row.path}:{row.line}"
    return "row ?" if index is None else f"row {index + 1}"


def source(rows: Any) -> str:
    """The file the rows were read from (the first row's), or ``"rows"`` when they were built in code."""
    for row in rows:
        return row.path if isinstance(row, Row) else "rows"
    return "rows"
