"""Paired bootstrap intervals over the questions of one sweep: per-row accuracy and bytes, and any claim number.

Every row of a sweep was measured on the same questions, so the resamples are *paired*: resample ``b`` draws one
multiset of question indices (:func:`resample_indices`) and every row is restricted to it, the LLM-only row included.
Bytes are relative to LLM-only on the same resample, and a claim (a function of the rows, e.g. "CITER's least bytes
at 98% of LLM-only accuracy") is recomputed on the resampled rows, so its interval carries the correlation between
the methods (they answer the same questions). Intervals are percentile intervals at ``level``.

A row takes part when its per-question vectors (``correct``, ``question_bytes``) are aligned with the LLM-only row's
(same non-zero length; same ``examples_hash`` when both have one). Other rows (read from files written before
intervals, or measured on a subset such as ``speculative`` with ``speculative_examples``) are kept unchanged in
every resample and get no interval; with no aligned LLM-only row nothing is resampled and intervals are None.

Pure numpy: rows in, numbers out.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from citer.evaluation.sweep_rows import SweepRow, rows_of

Stat = Callable[[list[SweepRow]], float | None]
MultiStat = Callable[[list[SweepRow]], Mapping[str, float | None]]


def resample_indices(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """``(n_resamples, n)`` question indices drawn with replacement (numpy ``Generator(PCG64(seed))``); the same
    array is used for every row (paired bootstrap), so the same ``seed`` and ``n`` give the same resamples."""
    if n <= 0 or n_resamples <= 0:
        return np.zeros((max(n_resamples, 0), max(n, 0)), dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, n, size=(n_resamples, n), dtype=np.int64)


@dataclass(frozen=True)
class _Paired:
    """The rows' per-question data as arrays: ``C``/``Q`` are ``(P, n)`` for the aligned rows ``pos`` (indices into
    the rows); ``llm`` is the LLM-only row's index in ``pos``; ``bytes_sum`` is each row's ``sum(question_bytes)``."""

    pos: np.ndarray
    C: np.ndarray
    Q: np.ndarray
    llm: int
    bytes_sum: np.ndarray


def _paired(rows: Sequence[SweepRow]) -> _Paired | None:
    llm_rows = rows_of(rows, "llm")
    if not llm_rows:
        return None
    ref = llm_rows[0]
    n = len(ref.correct)
    if n == 0 or len(ref.question_bytes) != n:
        return None
    pos = [
        i
        for i, r in enumerate(rows)
        if len(r.correct) == n
        and len(r.question_bytes) == n
        and (not r.examples_hash or not ref.examples_hash or r.examples_hash == ref.examples_hash)
    ]
    C = np.asarray([rows[i].correct for i in pos], dtype=np.float64).reshape(len(pos), n)
    Q = np.asarray([rows[i].question_bytes for i in pos], dtype=np.float64).reshape(len(pos), n)
    llm = next(j for j, i in enumerate(pos) if rows[i] is ref)
    return _Paired(np.asarray(pos, dtype=np.int64), C, Q, llm, Q.sum(axis=1))


def aligned(rows: Sequence[SweepRow]) -> list[bool]:
    """For each row: does it take part in the resamples (per-question data aligned with the LLM-only row's)? All
    False when the LLM-only row has none."""
    p = _paired(rows)
    keep = set() if p is None else set(p.pos.tolist())
    return [i in keep for i in range(len(rows))]


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    """``(B, n)`` how often each question is drawn in each resample of ``idx`` ``(B, n)``."""
    B = idx.shape[0]
    flat = (np.arange(B, dtype=np.int64)[:, None] * n + idx).ravel()
    return np.bincount(flat, minlength=B * n).reshape(B, n).astype(np.float64)


def _resampled_numbers(
    rows: Sequence[SweepRow], p: _Paired, W: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Accuracy, bytes_moved and bytes_moved_rel_llm ``(B, P)`` of the aligned rows under count weights ``W``.

    Bytes scale each row's own totals by the share of its per-question bytes drawn: ``bytes_moved_b = bytes_moved
    * S_b / S`` and ``rel_b = rel * (S_b / S) / (S_llm_b / S_llm)`` with ``S = sum(question_bytes)``. When a row's
    totals are the sums of its per-question bytes (as ``passes.to_row`` writes them) this is exactly
    ``sum(Q_row[idx]) / sum(Q_llm[idx])``, and on the full sample it gives back the row's own numbers."""
    acc = W @ p.C.T / W.sum(axis=1, keepdims=True)
    S = W @ p.Q.T
    full = np.where(p.bytes_sum > 0, p.bytes_sum, 1.0)
    share = np.where(p.bytes_sum > 0, S / full, 1.0)
    bytes_moved = np.asarray([rows[i].bytes_moved for i in p.pos], dtype=np.float64)
    rel = np.asarray([rows[i].bytes_moved_rel_llm for i in p.pos], dtype=np.float64)
    llm_share = share[:, p.llm : p.llm + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_b = rel * share / llm_share
    return acc, bytes_moved * share, rel_b


def _copies(
    rows: Sequence[SweepRow],
    p: _Paired,
    idx: np.ndarray,
    acc: np.ndarray,
    byts: np.ndarray,
    rel: np.ndarray,
) -> list[SweepRow]:
    """Shallow copies of ``rows`` with the aligned ones restricted to the question indices ``idx`` (1-d)."""
    out = list(rows)
    correct = p.C[:, idx].astype(bool).tolist()
    qbytes = p.Q[:, idx].tolist()
    llm_acc = float(acc[p.llm])
    for j, i in enumerate(p.pos.tolist()):
        r = copy.copy(rows[i])
        r.accuracy = float(acc[j])
        r.bytes_moved = float(byts[j])
        r.bytes_moved_rel_llm = float(rel[j])
        r.llm_accuracy = llm_acc
        r.n_examples = len(idx)
        r.correct = correct[j]
        r.question_bytes = qbytes[j]
        r.accuracy_ci = None
        r.bytes_ci = None
        out[i] = r
    return out


def resampled(rows: Sequence[SweepRow], idx: np.ndarray | Sequence[int]) -> list[SweepRow]:
    """Copies of ``rows`` restricted to the questions ``idx`` (1-d, repeats allowed): accuracy, bytes_moved,
    bytes_moved_rel_llm (vs the LLM-only row on the same questions), llm_accuracy, n_examples, ``correct`` and
    ``question_bytes`` recomputed; intervals cleared; other fields kept (``extra`` is shared, not copied). Rows
    without aligned per-question data are returned as they are (the same objects)."""
    p = _paired(rows)
    if p is None:
        return list(rows)
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    W = _counts(idx[None, :], p.C.shape[1])
    acc, byts, rel = _resampled_numbers(rows, p, W)
    return _copies(rows, p, idx, acc[0], byts[0], rel[0])


def percentile(values: np.ndarray | Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1, linear interpolation as numpy's default) of finite or infinite values; where the
    interpolation would mix an infinity with another value it returns the outer one (the lower value for
    ``q < 0.5``, the upper otherwise), so an interval never narrows because of an infinity. NaN are dropped."""
    v = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))
    v = v[~np.isnan(v)]
    if v.size == 0:
        return math.nan
    pos = q * (v.size - 1)
    i = int(math.floor(pos))
    f = pos - i
    a = float(v[i])
    if f == 0.0 or i + 1 >= v.size:
        return a
    b = float(v[i + 1])
    if a == b:
        return a
    if math.isinf(a) or math.isinf(b):
        return a if q < 0.5 else b
    return a + (b - a) * f


def interval(values: np.ndarray | Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The percentile interval ``[q_(1-level)/2, q_(1+level)/2]`` of ``values`` ignoring NaN (None if none)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if np.isnan(v).all():
        return None
    tail = (1.0 - level) / 2.0
    return percentile(v, tail), percentile(v, 1.0 - tail)


def attach_intervals(
    rows: Sequence[SweepRow], n_resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> None:
    """Set ``accuracy_ci`` and ``bytes_ci`` (bytes relative to LLM-only on the same resample) of every row with
    aligned per-question data, in place; other rows are left as they are (they may hold intervals read from a file).
    The LLM-only row's ``bytes_ci`` is (1.0, 1.0) by construction."""
    p = _paired(rows)
    if p is None or n_resamples <= 0:
        return
    W = _counts(resample_indices(p.C.shape[1], n_resamples, seed), p.C.shape[1])
    acc, _, rel = _resampled_numbers(rows, p, W)
    tail = (1.0 - level) / 2.0
    qs = [tail, 1.0 - tail]
    acc_q = np.quantile(acc, qs, axis=0)
    with warnings.catch_warnings():  # a column of NaN (LLM-only moved no bytes) gives NaN: no interval
        warnings.simplefilter("ignore", RuntimeWarning)
        rel_q = np.nanquantile(np.where(np.isfinite(rel), rel, np.nan), qs, axis=0)
    for j, i in enumerate(p.pos.tolist()):
        rows[i].accuracy_ci = (float(acc_q[0, j]), float(acc_q[1, j]))
        lo, hi = float(rel_q[0, j]), float(rel_q[1, j])
        rows[i].bytes_ci = None if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def _as_float(x: float | None) -> float:
    """A statistic's result as a float: None -> NaN (ignored), infinities kept."""
    return math.nan if x is None else float(x)


def bootstrap_values(
    rows: Sequence[SweepRow], stat: MultiStat, n_resamples: int = 1000, seed: int = 0
) -> dict[str, np.ndarray] | None:
    """``stat`` (rows -> {name: number or None}) on every paired resample: {name: ``(n_resamples,)`` floats} with
    NaN where it returned None (infinities kept). None when the rows have no per-question data. The resamples are
    :func:`resample_indices` ``(n, n_resamples, seed)``, the same as :func:`attach_intervals` uses."""
    p = _paired(rows)
    if p is None or n_resamples <= 0:
        return None
    n = p.C.shape[1]
    idx = resample_indices(n, n_resamples, seed)
    acc, byts, rel = _resampled_numbers(rows, p, _counts(idx, n))
    out: dict[str, np.ndarray] = {}
    for b in range(n_resamples):
        got = stat(_copies(rows, p, idx[b], acc[b], byts[b], rel[b]))
        for k, v in got.items():
            if k not in out:
                out[k] = np.full(n_resamples, math.nan)
            out[k][b] = _as_float(v)
    return out


def json_number(x: Any) -> float | None:
    """A float for JSON: numpy scalars converted, NaN and infinities -> None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def json_safe(x: Any) -> Any:
    """Plain JSON, recursively: numpy scalars to Python, tuples to lists, NaN and infinities to None."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return json_number(x)
    return x


def ci_bounds(summary: Mapping[str, Any]) -> tuple[float, float]:
    """A :func:`summarise` dict's interval as floats, a None bound read as the infinity it stands for; (-inf, inf)
    when there is no interval."""
    ci = summary.get("ci")
    if ci is None:
        return -math.inf, math.inf
    return (-math.inf if ci[0] is None else ci[0]), (math.inf if ci[1] is None else ci[1])


def summarise(
    value: float | None, values: np.ndarray | None, level: float = 0.95, n_resamples: int = 0
) -> dict[str, Any]:
    """The JSON shape of one bootstrapped number: ``value``, ``ci`` ([lo, hi], a bound None where it is infinite;
    ``ci`` None when there are no resamples or none is valid), ``n_valid`` (resamples where the statistic was not
    None), ``n_resamples`` and ``level``."""
    ci = None
    n_valid = 0
    if values is not None:
        n_valid = int((~np.isnan(values)).sum())
        got = interval(values, level) if n_valid else None
        if got is not None:
            ci = [json_number(got[0]), json_number(got[1])]
    return {
        "value": json_number(value),
        "ci": ci,
        "n_valid": n_valid,
        "n_resamples": int(n_resamples) if values is not None else 0,
        "level": float(level),
    }


def bootstrap_stat(
    rows: Sequence[SweepRow],
    stat: Stat,
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """Any claim number with a paired-bootstrap interval: ``stat`` (rows -> number or None) on the full rows
    (``value``) and on each resample (:func:`resampled`); ``ci`` is the percentile interval over the resamples where
    it was not None (their count is ``n_valid``). A statistic may return ±inf (e.g. "the target is never reached" as
    +inf bytes): infinities take part in the percentiles and show as a None bound in ``ci`` (and a None
    ``value``). ``ci`` is None when the rows have no per-question data. See :func:`summarise` for the shape."""
    value = stat(list(rows))
    got = bootstrap_values(rows, lambda rs: {"stat": stat(rs)}, n_resamples, seed)
    values = None if got is None else got.get("stat", np.full(n_resamples, math.nan))
    return summarise(value, values, level, n_resamples)
