"""Router metrics (AUC, calibration, the per-router record) and ``reports/router.json``.

Kept apart from :mod:`citer.routing.mlp` (which re-exports every name) so each module stays small.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from citer.ops.io import write_json
from citer.routing.features import RouterError
from citer.routing.label_store import CASES, LabelSet

# ----------------------------------------------------------------------------------------------------------------
# Metrics


def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN when y has one class."""
    y = np.asarray(y).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = np.asarray(score)[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):  # average ranks over runs of equal scores
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty_like(ranks)
    r[order] = ranks
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def expected_calibration_error(y: np.ndarray, prob: np.ndarray, n_bins: int = 10) -> float:
    """Mean |accuracy - confidence| over equal-width probability bins, weighted by bin size."""
    y, prob = np.asarray(y, dtype=np.float64), np.asarray(prob, dtype=np.float64)
    bins = np.minimum((prob * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(y[m].mean() - prob[m].mean())
    return float(ece)


@dataclass
class RouterMetrics:
    """What the flow logs: the best epoch's validation numbers plus per-epoch curves."""

    val_loss: float
    val_auc: float
    val_accuracy: float
    val_ece: float
    label_balance: float  # fraction of training tokens labelled SLM-preferred
    pos_weight: float
    best_epoch: int
    epochs_run: int
    n_train: int
    n_val: int
    n_train_examples: int
    n_val_examples: int
    curves: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scalars(self) -> dict[str, float]:
        """Flat numeric metrics (no curves) for ``mlflow.log_metrics``."""
        return {k: float(v) for k, v in asdict(self).items() if k != "curves"}


REPORT_KEYS = ("iteration", "n_tokens", "case_counts", "val_auc", "val_loss")


def iteration_summary(ls: LabelSet, metrics: RouterMetrics) -> dict[str, Any]:
    """One entry of ``reports/router.json`` (the contract keys plus a few extras for the README)."""
    return {
        "iteration": ls.iteration,
        "n_tokens": ls.n_tokens,
        "case_counts": ls.case_counts(),
        "val_auc": metrics.val_auc,
        "val_loss": metrics.val_loss,
        "val_accuracy": metrics.val_accuracy,
        "val_ece": metrics.val_ece,
        "label_balance": metrics.label_balance,
        "n_changed": int(ls.meta.get("n_changed", 0)),
        "citer_s": bool(ls.meta.get("citer_s", False)),
    }


def write_router_report(path: str | os.PathLike[str], iterations: Sequence[Mapping[str, Any]]) -> Path:
    """``{"iterations": [...]}``; every entry needs REPORT_KEYS (build them with :func:`iteration_summary`)."""
    entries = []
    for i, it in enumerate(iterations):
        missing = [k for k in REPORT_KEYS if k not in it]
        if missing:
            raise RouterError(f"router report: entry {i}, fields {missing} missing")
        counts = it["case_counts"]
        if set(counts) - set(CASES):
            raise RouterError(
                f"router report: entry {i}, field case_counts has unknown cases {sorted(set(counts) - set(CASES))}"
            )
        entry = dict(it)
        entry.update(
            iteration=int(it["iteration"]),
            n_tokens=int(it["n_tokens"]),
            case_counts={c: int(counts.get(c, 0)) for c in CASES},
            val_auc=float(it["val_auc"]),
            val_loss=float(it["val_loss"]),
        )
        entries.append(entry)
    write_json(path, {"iterations": entries})
    return Path(path)
