"""Routed batch inference over a JSONL file of questions, resumable after a kill.

Output: one JSON line per non-blank input line, in input order::

    {"index": 0, "line": 1, "question": "...", "response": "...", "answer": "7", "correct": true, "n_tokens": 31, "llm_tokens": 4,
     "llm_token_fraction": 0.129, "llm_calls": 2, "bytes_moved": 1.2e6, "spans": [["7 + 3 = ", "slm"], ["1", "llm"], ...]}
    {"index": 1, "line": 2, "error": "field 'problem': missing required key"}

``spans``: the response cut into runs of tokens written by one model (``citer report html`` colours them).
``correct`` is present only when the row carries a reference (math ``solution`` / mc ``answerKey``). Up to
``batch_size`` rows decode at once, and a row that finishes is replaced by the next at the following step
(continuous batching, :class:`~citer.decoding.session.DecodeSession`). Input lines are cut into chunks of
``CHUNK_BATCHES * batch_size`` (errors included) and each chunk is appended in one write followed by fsync. A rerun
drops a torn last line and any chunk not written in full, then decodes the remaining chunks; with the same
``batch_size`` they line up with the first run's, so the final file is identical to an uninterrupted run's.
A sidecar ``<output>.meta.json`` records the input's hash and the settings (router version, τ, models); an output
written with other settings is refused, or started over with ``restart_on_change`` (what the pipeline does).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from citer.data.answers import extract_answer, grade
from citer.data.formats import FORMATS, Format, question_text, structural_problems
from citer.data.jsonl import iter_raw_lines
from citer.data.prompts import build_prompt
from citer.decoding.engine import EngineInputError
from citer.ops.io import file_digest, write_json

# Input lines per durable write, in batches: a chunk keeps its rows' batch full as rows finish (continuous batching).
CHUNK_BATCHES = 4

# Reference fields: a question without them is routed but not graded.
_REFERENCE = {"math": ("solution",), "mc": ("answerKey",)}


class InferenceError(ValueError):
    """An output file that cannot be resumed (another input, a corrupt line); the message names file and line."""


@dataclass
class InferenceSummary:
    """The whole output file after this run (resumed rows included) and what this run did."""

    n: int
    n_errors: int
    n_skipped: int  # already in the output when this run started
    n_processed: int  # decoded or reported by this run
    n_graded: int
    accuracy: float | None
    n_tokens: int
    llm_token_fraction: float
    llm_calls: int
    bytes_moved: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Item:
    index: int
    line: int
    row: dict[str, Any] | None
    error: str | None


def _read_items(path: Path, fmt: Format) -> list[_Item]:
    """Every non-blank input line, with the reason it cannot be routed (never raises for a bad line)."""
    items: list[_Item] = []
    for raw in iter_raw_lines(path):
        if raw.text is not None and not raw.text.strip():
            continue
        idx = len(items)
        if raw.text is None:
            items.append(_Item(idx, raw.line, None, raw.problem or "unreadable line"))
            continue
        try:
            obj = json.loads(raw.text)
        except ValueError as exc:
            items.append(_Item(idx, raw.line, None, f"not valid JSON: {exc}"))
            continue
        # A missing reference is fine here (questions only); every other structural problem is not.
        problems = [
            p
            for p in structural_problems(obj, fmt)
            if not (p.field in _REFERENCE[fmt] and p.reason == "missing required key")
        ]
        if problems:
            p = problems[0]
            items.append(
                _Item(idx, raw.line, None, p.reason if p.field is None else f"field {p.field!r}: {p.reason}")
            )
        else:
            items.append(_Item(idx, raw.line, obj, None))
    return items


def _file_hash(path: Path) -> str:
    return file_digest(path)


def _scan_output(output: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows already written, in order, and the byte offset just past each one.

    A torn last line (no newline, or not JSON: a kill mid-write) is left out; any other bad line is refused. Rows
    must be indices 0, 1, 2, ... in order, as :func:`route_file` writes them.
    """
    if not output.exists():
        return [], []
    data = output.read_bytes()
    rows: list[dict[str, Any]] = []
    ends: list[int] = []
    pos = 0
    lineno = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # torn: no newline
        lineno += 1
        raw = data[pos:nl]
        try:
            obj = json.loads(raw)
            idx = int(obj["index"])
        except (ValueError, KeyError, TypeError) as exc:
            if nl + 1 == len(data):  # the last line, garbled: a torn write as well
                break
            raise InferenceError(
                f"{output}:{lineno}: not an output row ({exc}); delete the file to start over"
            ) from exc
        if idx != len(rows):
            raise InferenceError(
                f"{output}:{lineno}: field index={idx}, expected {len(rows)} (rows are written in input order); "
                "delete the file to start over"
            )
        rows.append(obj)
        ends.append(nl + 1)
        pos = nl + 1
    return rows, ends


def _truncate(output: Path, size: int) -> None:
    with output.open("r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def _meta_changes(meta_path: Path, meta: Mapping[str, Any]) -> list[str]:
    """The settings that differ from those the existing output was written with (none known without a sidecar)."""
    if not meta_path.exists():
        return []
    try:
        old = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError:
        return [f"{meta_path.name}: not valid JSON"]
    return [f"{k}: {old.get(k)!r} -> {meta[k]!r}" for k in meta if old.get(k) != meta[k]]


def _stats_out(st: Any, n_tokens: int) -> dict[str, Any]:
    llm_tokens = int(getattr(st, "llm_tokens", 0))
    return {
        "n_tokens": n_tokens,
        "llm_tokens": llm_tokens,
        "llm_token_fraction": llm_tokens / n_tokens if n_tokens else 0.0,
        "llm_calls": int(getattr(st, "llm_calls", 0)),
        "bytes_moved": float(getattr(st, "bytes_moved", 0.0)),
        "rolled_back_tokens": int(getattr(st, "rolled_back_tokens", 0)),
    }


def _generate(
    engine: Any, pairs: list[tuple[_Item, list[int]]], max_new_tokens: int, batch_size: int
) -> list[tuple[list[int], Any, list[bool], list[tuple[int, list[int]]]]]:
    # row_ids = input indices: a random router or sampler then draws the same numbers whatever the batch.
    res = engine.generate_batch(
        [ids for _, ids in pairs],
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        row_ids=[it.index for it, _ in pairs],
        max_rows=batch_size,
    )
    replaced = res.replaced or [[] for _ in res.tokens]
    return list(zip(res.tokens, res.rows, res.from_llm, replaced, strict=True))


def writer_spans(
    tokenizer: Any,
    toks: list[int],
    from_llm: list[bool],
    replaced: list[tuple[int, list[int]]] | None = None,
) -> list[list[str]]:
    """The response as ``[text, "slm"|"llm"]`` runs of tokens written by one model (the report's token view).
    Each run's text is the growth of the decoded prefix, so pieces join to the decoded response. ``replaced``
    (verified routing: ``(index, SLM tokens the LLM's token at index took back)``) adds ``[text, "rolled_back"]``
    pieces where they were taken back; they are not part of the response."""
    out: list[list[str]] = []
    cuts = dict(replaced or [])
    done = ""
    i = 0
    while i < len(toks):
        if i in cuts:
            gone = tokenizer.decode(list(toks[:i]) + list(cuts[i]), skip_special_tokens=True)[len(done) :]
            if gone:
                out.append([gone, "rolled_back"])
        j = i
        while j < len(toks) and from_llm[j] == from_llm[i] and (j == i or j not in cuts):
            j += 1
        text = tokenizer.decode(list(toks[:j]), skip_special_tokens=True)
        piece, who = text[len(done) :], "llm" if from_llm[i] else "slm"
        if piece and out and out[-1][1] == who:  # the run between wrote no text (e.g. a special token)
            out[-1][0] += piece
        elif piece:
            out.append([piece, who])
        done, i = text, j
    return out


def _decode_chunk(
    engine: Any, tokenizer: Any, chunk: list[_Item], fmt: Format, max_new_tokens: int, batch_size: int
) -> list[dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    ok: list[tuple[_Item, list[int]]] = []
    for it in chunk:
        if it.error is not None:
            out[it.index] = {"index": it.index, "line": it.line, "error": it.error}
            continue
        assert it.row is not None
        ids = tokenizer.encode(build_prompt(it.row, fmt), add_special_tokens=False)
        if not ids:
            out[it.index] = {"index": it.index, "line": it.line, "error": "prompt encodes to no tokens"}
            continue
        ok.append((it, list(ids)))
    if ok:
        try:
            results = _generate(engine, ok, max_new_tokens, batch_size)
        except EngineInputError:
            # One prompt the engine refuses (too long for a model's context) must not sink its batch-mates:
            # decode row by row and report the refused ones. Deterministic, so a rerun writes the same lines.
            results = []
            for pair in ok:
                try:
                    results += _generate(engine, [pair], max_new_tokens, batch_size)
                except EngineInputError as exc:
                    err = f"engine refused the prompt: {exc}"
                    out[pair[0].index] = {"index": pair[0].index, "line": pair[0].line, "error": err}
            ok = [pair for pair in ok if pair[0].index not in out]
        for (it, _), (toks, st, by_llm, cuts) in zip(ok, results, strict=True):
            assert it.row is not None
            text = tokenizer.decode(list(toks), skip_special_tokens=True)
            rec: dict[str, Any] = {"index": it.index, "line": it.line}
            if "id" in it.row:
                rec["id"] = it.row["id"]
            rec["question"] = question_text(it.row, fmt)  # the report's token view shows what was asked
            # A response naming a choice's text is recorded as that choice's label.
            choices = it.row.get("choices") if fmt == "mc" else None
            rec.update(response=text, answer=extract_answer(text, fmt, choices))
            if all(k in it.row for k in _REFERENCE[fmt]):
                try:
                    rec["correct"] = bool(grade(text, it.row, fmt))
                except ValueError as exc:  # e.g. a math reference without a final box
                    rec["grade_error"] = str(exc)
            rec.update(_stats_out(st, len(toks)))
            rec["spans"] = writer_spans(tokenizer, list(toks), list(by_llm), cuts)
            out[it.index] = rec
    return [out[it.index] for it in chunk]


def _summarise(
    done: Mapping[int, Mapping[str, Any]], n_skipped: int, n_processed: int, seconds: float
) -> InferenceSummary:
    rows = [done[i] for i in sorted(done)]
    graded = [r["correct"] for r in rows if "correct" in r]
    n_tokens = sum(int(r.get("n_tokens", 0)) for r in rows)
    llm_tokens = sum(int(r.get("llm_tokens", 0)) for r in rows)
    return InferenceSummary(
        n=len(rows),
        n_errors=sum("error" in r for r in rows),
        n_skipped=n_skipped,
        n_processed=n_processed,
        n_graded=len(graded),
        accuracy=sum(graded) / len(graded) if graded else None,
        n_tokens=n_tokens,
        llm_token_fraction=llm_tokens / n_tokens if n_tokens else 0.0,
        llm_calls=sum(int(r.get("llm_calls", 0)) for r in rows),
        bytes_moved=float(sum(float(r.get("bytes_moved", 0.0)) for r in rows)),
        seconds=seconds,
    )


def write_without_champion(
    input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], fmt: Format, status: str
) -> None:
    """What batch inference leaves when no router holds the alias: an empty (valid) output and a sidecar whose
    ``status`` says why. A later run with a champion starts the file over (no rows to resume)."""
    from citer.ops.io import write_text

    inp, output = Path(input_path), Path(output_path)
    write_text(output, "")
    meta = {"input_sha256": _file_hash(inp), "fmt": fmt, "status": status}
    write_json(output.with_name(output.name + ".meta.json"), meta)


def route_file(
    engine: Any | Callable[[], Any],
    tokenizer: Any,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    fmt: Format,
    batch_size: int = 32,
    max_new_tokens: int = 96,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
    restart_on_change: bool = False,
) -> InferenceSummary:
    """Route every question of ``input_path`` through ``engine`` into ``output_path`` (see the module docstring).

    ``engine`` is a RoutedEngine, or a zero-argument factory called only when something is left to decode (so a
    finished file needs no models). ``meta`` (e.g. the router version and τ) joins the sidecar's resume check: an
    output written with other settings is refused, or with ``restart_on_change`` written again from the start.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1 (got {batch_size}, {max_new_tokens})")
    t0 = time.perf_counter()
    inp, output = Path(input_path), Path(output_path)
    items = _read_items(inp, fmt)
    output.parent.mkdir(parents=True, exist_ok=True)
    written, ends = _scan_output(output)
    if len(written) > len(items):
        raise InferenceError(f"{output}: holds {len(written)} rows but {inp} has {len(items)}; delete it")
    run_meta = {
        "input_sha256": _file_hash(inp),
        "fmt": fmt,
        "max_new_tokens": max_new_tokens,
        **dict(meta or {}),
    }
    meta_path = output.with_name(output.name + ".meta.json")
    changes = _meta_changes(meta_path, run_meta) if written else []
    if changes and not restart_on_change:
        raise InferenceError(
            f"{output}: was written for another run ({'; '.join(changes)}); delete it or choose another output path"
        )
    # Build the engine (load and verify the champion) before touching the output: a refused champion leaves the
    # previous predictions as they were.
    eng = None
    if changes or len(written) < len(items):
        eng = engine if hasattr(engine, "generate_batch") else engine()
    if changes:  # another input, champion or τ: those rows answer other questions, so start over
        written, ends = [], []
        _truncate(output, 0)
    write_json(meta_path, run_meta)
    # Keep whole chunks only: a chunk cut short is decoded again in full, so every row is decoded in the same
    # batch as in an uninterrupted run (bytes_moved shares each call's weight read among the rows of its batch).
    rows = CHUNK_BATCHES * batch_size
    chunk_ends = [min(s + rows, len(items)) for s in range(0, len(items), rows)]
    n_keep = max([e for e in chunk_ends if e <= len(written)], default=0)
    size = ends[n_keep - 1] if n_keep else 0
    if output.exists() and output.stat().st_size != size:
        _truncate(output, size)
    done = {i: written[i] for i in range(n_keep)}
    n_skipped = len(done)
    # Chunks are fixed by position, so a rerun decodes exactly the batches the killed run would have.
    chunks = [items[s : s + rows] for s in range(0, len(items), rows)]
    todo = [ch for ch in chunks if ch[0].index not in done]
    n_processed = 0
    if todo:
        from citer.ops.progress import bar as progress_bar

        if eng is None:
            eng = engine if hasattr(engine, "generate_batch") else engine()
        # One switch for every bar (CITER_PROGRESS), shown on an interactive terminal only.
        bar = progress_bar(f"route {inp.name}", total=sum(len(c) for c in todo), unit="q", enabled=progress)
        with output.open("ab") as fh:
            for ch in todo:
                recs = _decode_chunk(eng, tokenizer, ch, fmt, max_new_tokens, batch_size)
                fh.write(b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in recs))
                fh.flush()
                os.fsync(fh.fileno())
                for r in recs:
                    done[int(r["index"])] = r
                n_processed += len(recs)
                bar.update(len(recs))
        bar.close()
    return _summarise(done, n_skipped, n_processed, time.perf_counter() - t0)
