"""A token-level preference label set: the in-memory type, its files on disk and its data-quality suite.

On disk (``artifacts/labels/iter{k}/``, see docs/contracts.md)::

    hidden.safetensors   tensor ``hidden`` (N, H): the SLM's last hidden state that predicts each target token
    tokens.parquet       one row per target token; ``row`` indexes ``hidden``
    meta.json            hidden_size, slm, llm, fmt, iteration, case_counts, rows_hash, ...

Collection lives in :mod:`citer.routing.labels`; this module only stores, loads and checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from citer.ops.io import atomic_dir, read_artifact_meta

CASES: tuple[str, ...] = ("slm_correct", "llm_correct", "both_wrong")
SLM_PREFERRED = 1
LLM_PREFERRED = 0

HIDDEN_FILE = "hidden.safetensors"
TOKENS_FILE = "tokens.parquet"
META_FILE = "meta.json"

# Column -> dtype of tokens.parquet; the first six are the contract, the rest help debugging and iteration k.
COLUMNS: dict[str, str] = {
    "example_id": "str",
    "position": "int64",
    "case": "str",
    "label": "int64",
    "iteration": "int64",
    "row": "int64",
    "slm_token": "int64",
    "llm_token": "int64",
    "ref_token": "int64",
}


class LabelsError(ValueError):
    """A label set that cannot be used; the message names the file (or object), the row and the field."""


@dataclass
class LabelSet:
    """Hidden states (N, H) plus one table row per target token (``row`` indexes ``hidden``)."""

    hidden: torch.Tensor  # (N, H) float16 or float32
    tokens: pd.DataFrame  # N rows, COLUMNS
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[1])

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def iteration(self) -> int:
        return int(self.meta.get("iteration", 1))

    def case_counts(self) -> dict[str, int]:
        counts = self.tokens["case"].value_counts()
        return {c: int(counts.get(c, 0)) for c in CASES}

    def label_counts(self) -> dict[str, int]:
        n_slm = int((self.tokens["label"] == SLM_PREFERRED).sum())
        return {"slm": n_slm, "llm": int(len(self.tokens) - n_slm)}

    def hidden_for_rows(self) -> torch.Tensor:
        """Hidden states in table order, float32: (N, H)."""
        return self.hidden[torch.as_tensor(self.tokens["row"].to_numpy().copy(), dtype=torch.long)].float()


def make_tokens_table(records: dict[str, list[Any]]) -> pd.DataFrame:
    """A tokens table with the contract's columns and dtypes, in COLUMNS order."""
    missing = [c for c in COLUMNS if c not in records]
    if missing:
        raise LabelsError(f"tokens table: missing columns {missing}")
    df = pd.DataFrame({c: records[c] for c in COLUMNS})
    return df.astype(COLUMNS)


def labelset_hash(ls: LabelSet) -> str:
    """sha256 over the labels and hidden states: identifies the data a router was trained on."""
    h = hashlib.sha256()
    cols = ["example_id", "position", "case", "label", "row"]
    h.update(ls.tokens[cols].to_json(orient="values").encode())
    h.update(ls.hidden.contiguous().to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def save_labels(ls: LabelSet, path: str | os.PathLike[str]) -> Path:
    """Write the three files into ``path`` atomically (a crash leaves the previous directory or none)."""
    _check_structure(ls, where=str(path))
    meta = dict(ls.meta)
    meta.update(hidden_size=ls.hidden_size, n_tokens=ls.n_tokens, case_counts=ls.case_counts())
    with atomic_dir(path) as tmp:
        save_file({"hidden": ls.hidden.contiguous()}, str(tmp / HIDDEN_FILE))
        ls.tokens.to_parquet(tmp / TOKENS_FILE, index=False)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return Path(path)


def load_labels(path: str | os.PathLike[str], expected_hidden_size: int | None = None) -> LabelSet:
    """Read a label directory; raises :class:`LabelsError` naming the file and field when it is unusable."""
    d = Path(path)
    meta = read_artifact_meta(d, (HIDDEN_FILE, TOKENS_FILE, META_FILE), META_FILE, LabelsError, "save_labels")
    tensors = load_file(str(d / HIDDEN_FILE))
    if "hidden" not in tensors:
        raise LabelsError(f"{d / HIDDEN_FILE}: no tensor named 'hidden' (found {sorted(tensors)})")
    hidden = tensors["hidden"]
    tokens = pd.read_parquet(d / TOKENS_FILE)
    missing = [c for c in COLUMNS if c not in tokens.columns]
    if missing:
        raise LabelsError(f"{d / TOKENS_FILE}: missing columns {missing}")
    for col, dtype in COLUMNS.items():
        try:
            tokens[col] = tokens[col].astype(dtype)
        except (TypeError, ValueError) as exc:
            bad = tokens[col].isna()
            row = f"row {int(bad.to_numpy().argmax())}, " if bad.any() else ""
            raise LabelsError(
                f"{d / TOKENS_FILE}: {row}field {col} not convertible to {dtype} ({exc})"
            ) from exc
    ls = LabelSet(hidden=hidden, tokens=tokens[list(COLUMNS)], meta=meta)
    _check_structure(ls, where=str(d))
    if meta.get("hidden_size") != ls.hidden_size:
        raise LabelsError(
            f"{d / META_FILE}: field hidden_size={meta.get('hidden_size')} but {HIDDEN_FILE} has H={ls.hidden_size}"
        )
    if expected_hidden_size is not None and ls.hidden_size != expected_hidden_size:
        raise LabelsError(
            f"{d / HIDDEN_FILE}: field hidden has size {ls.hidden_size} but the SLM's hidden size is "
            f"{expected_hidden_size} (labels collected with another SLM: {meta.get('slm')!r})"
        )
    return ls


def _check_structure(ls: LabelSet, where: str) -> None:
    """Shape-level consistency that every later step relies on (cheap; the GE suite checks values)."""
    if ls.hidden.dim() != 2:
        raise LabelsError(f"{where}: field hidden must be 2-D (N, H), got shape {tuple(ls.hidden.shape)}")
    if ls.n_tokens == 0:
        raise LabelsError(f"{where}: empty label set (no target tokens)")
    rows = ls.tokens["row"].to_numpy()
    bad = np.flatnonzero((rows < 0) | (rows >= ls.hidden.shape[0]))
    if bad.size:
        i = int(bad[0])
        raise LabelsError(
            f"{where}: row {i}, field row={int(rows[i])} outside hidden (N={ls.hidden.shape[0]})"
        )


class _Suite:
    """The Great Expectations suite on the tokens table (built lazily: importing GE costs seconds)."""

    @staticmethod
    def run(df: pd.DataFrame) -> list[dict[str, Any]]:
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
        batch = (
            ctx.data_sources.add_pandas("labels")
            .add_dataframe_asset("tokens")
            .add_batch_definition_whole_dataframe("all")
            .get_batch(batch_parameters={"dataframe": df})
        )
        E = gx.expectations
        suite = gx.ExpectationSuite(name="citer_labels")
        for col in COLUMNS:
            suite.add_expectation(E.ExpectColumnValuesToNotBeNull(column=col))
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="label", value_set=[0, 1]))
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="case", value_set=list(CASES)))
        suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="position", min_value=0))
        suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="iteration", min_value=1))
        suite.add_expectation(E.ExpectColumnValuesToBeUnique(column="row"))
        suite.add_expectation(E.ExpectCompoundColumnsToBeUnique(column_list=["example_id", "position"]))
        # Row-level rules computed in pandas (see STACK.md): finite hidden rows, and case/label agreement for the
        # two cases whose label the teacher-forced pass decides.
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="hidden_finite", value_set=[True]))
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="case_label_consistent", value_set=[True]))
        res = batch.validate(suite, result_format="COMPLETE")
        failures = []
        for r in res.results:
            if r.success:
                continue
            cfg = r.expectation_config
            idx = (r.result or {}).get("partial_unexpected_index_list") or (r.result or {}).get(
                "unexpected_index_list"
            )
            failures.append(
                {
                    "expectation": cfg.type,
                    "column": cfg.kwargs.get("column") or cfg.kwargs.get("column_list"),
                    "unexpected_count": (r.result or {}).get("unexpected_count"),
                    "first_rows": list(idx[:5]) if idx else [],
                    "exception": (r.exception_info or {}).get("exception_message"),
                }
            )
        return failures


def validate_labels(ls: LabelSet, hidden_size: int, *, raise_on_failure: bool = True) -> dict[str, Any]:
    """Run the label suite; returns ``{success, n_tokens, case_counts, label_counts, failures}`` for logging.

    Raises :class:`LabelsError` (listing every failed expectation with its first bad rows) unless
    ``raise_on_failure`` is False.
    """
    where = f"label set (iteration {ls.meta.get('iteration', '?')})"
    failures: list[dict[str, Any]] = []
    if ls.hidden.dim() != 2 or ls.hidden_size != hidden_size:
        failures.append(
            {"expectation": "hidden_size_matches_slm", "column": "hidden", "observed": list(ls.hidden.shape)}
        )
    if ls.n_tokens == 0:
        failures.append({"expectation": "not_empty", "column": None, "observed": 0})
    if not failures:
        df = ls.tokens.copy()
        rows = torch.as_tensor(df["row"].to_numpy().copy(), dtype=torch.long).clamp(0, ls.hidden.shape[0] - 1)
        finite = torch.isfinite(ls.hidden.float()).all(dim=1)  # (N,)
        df["hidden_finite"] = finite[rows].numpy()
        decided = {"slm_correct": SLM_PREFERRED, "llm_correct": LLM_PREFERRED}
        expect = df["case"].map(decided)
        df["case_label_consistent"] = expect.isna() | (expect == df["label"])
        failures = _Suite.run(df)
    report = {
        "success": not failures,
        "n_tokens": ls.n_tokens,
        "case_counts": ls.case_counts() if ls.n_tokens else {c: 0 for c in CASES},
        "label_counts": ls.label_counts() if ls.n_tokens else {"slm": 0, "llm": 0},
        "failures": failures,
    }
    if failures and raise_on_failure:
        lines = "; ".join(
            f"{f['expectation']} on {f['column']}"
            + (f" (rows {f['first_rows']})" if f.get("first_rows") else "")
            + (f" observed {f['observed']}" if "observed" in f else "")
            for f in failures
        )
        raise LabelsError(f"{where}: validation failed (expected hidden size {hidden_size}): {lines}")
    return report
