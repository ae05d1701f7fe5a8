"""The MLP router of CITER: the SLM's hidden state -> P(the SLM's token is good enough).

Architecture as in the paper: ``h -> 2h -> h -> 1`` with BatchNorm, ReLU and dropout after both hidden layers, then a
sigmoid. Trained with BCE on "SLM preferred" labels, validation split by example (tokens of one example are highly
correlated, so a token-level split would leak), early stopping on validation loss that keeps the best epoch.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from citer.config import RouterParams
from citer.io import atomic_dir, read_artifact_meta, write_json
from citer.progress import progress
from citer.routing.label_store import CASES, LabelSet, labelset_hash

WEIGHTS_FILE = "router.safetensors"
META_FILE = "router.json"


class RouterError(ValueError):
    """A router input or checkpoint that cannot be used; the message names the file or object and the field."""


class MLPRouter(nn.Module):
    """``forward(hidden (B, H)) -> scores (B,)`` in [0, 1]; the engine's router interface (docs/contracts.md)."""

    def __init__(self, hidden_size: int, dropout: float = 0.1) -> None:
        super().__init__()
        h = hidden_size
        self.hidden_size = h
        self.dropout = dropout
        self.net = nn.Sequential(
            nn.Linear(h, 2 * h),
            nn.BatchNorm1d(2 * h),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(2 * h, h),
            nn.BatchNorm1d(h),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(h, 1),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) any float dtype/device -> (B,) float32 logits on the module's device."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise RouterError(
                f"router input: field hidden has shape {tuple(hidden.shape)}, expected (B, {self.hidden_size})"
            )
        p = self.net[0].weight
        return self.net(hidden.to(device=p.device, dtype=p.dtype)).squeeze(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # No autograd graph at inference; scores come back on the caller's device to be compared with τ in place.
        with torch.set_grad_enabled(self.training and torch.is_grad_enabled()):
            return torch.sigmoid(self.logits(hidden)).to(hidden.device)


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


# ----------------------------------------------------------------------------------------------------------------
# Training


def split_by_example(
    example_ids: Sequence[str], val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token index arrays (train, val) such that no example has tokens on both sides."""
    ids = np.asarray(example_ids, dtype=object)
    uniq = sorted(set(ids.tolist()))
    if len(uniq) < 2:
        raise RouterError(
            f"label set: field example_id has {len(uniq)} distinct example(s); need >= 2 to validate"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(uniq))
    n_val = min(max(1, round(val_fraction * len(uniq))), len(uniq) - 1)
    val_ids = {uniq[i] for i in perm[:n_val]}
    is_val = np.fromiter((x in val_ids for x in ids), dtype=bool, count=len(ids))
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def _check_trainable(ls: LabelSet) -> None:
    if ls.n_tokens == 0:
        raise RouterError("label set: empty (no tokens); nothing to train on")
    labels = ls.tokens["label"]
    bad = labels[~labels.isin([0, 1])]
    if len(bad):
        raise RouterError(f"label set: row {int(bad.index[0])}, field label={bad.iloc[0]} not in {{0, 1}}")
    if labels.nunique() < 2:
        only = "SLM" if int(labels.iloc[0]) == 1 else "LLM"
        raise RouterError(
            f"label set: field label is {only}-preferred for all {ls.n_tokens} tokens; need both classes"
        )


@torch.no_grad()
def _evaluate(
    model: MLPRouter, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, bs: int
) -> dict[str, float]:
    model.eval()
    logits = torch.cat([model.logits(x[s : s + bs]) for s in range(0, len(x), bs)])  # (n,)
    loss = float(loss_fn(logits, y))
    prob = torch.sigmoid(logits).numpy()
    yn = y.numpy()
    return {
        "val_loss": loss,
        "val_auc": roc_auc(yn, prob),
        "val_accuracy": float(((prob >= 0.5) == (yn >= 0.5)).mean()),
        "val_ece": expected_calibration_error(yn, prob),
    }


def train_router(ls: LabelSet, params: RouterParams) -> tuple[MLPRouter, RouterMetrics]:
    """Fit an :class:`MLPRouter` on ``ls``; returns it in eval mode with the best epoch's weights."""
    _check_trainable(ls)
    x_all = ls.hidden_for_rows()  # (N, H) float32, table order
    if not torch.isfinite(x_all).all():
        raise RouterError("label set: field hidden contains NaN or inf")
    y_all = torch.as_tensor(ls.tokens["label"].to_numpy().copy(), dtype=torch.float32)  # (N,)
    tr, va = split_by_example(ls.tokens["example_id"].tolist(), params.val_fraction, params.seed)
    x_tr, y_tr, x_va, y_va = x_all[tr], y_all[tr], x_all[va], y_all[va]
    n_pos = float(y_tr.sum())
    n_neg = float(len(y_tr) - n_pos)
    if n_pos == 0 or n_neg == 0:
        raise RouterError("label set: the training split holds one class only; use more examples")
    # pos_weight = n_neg / n_pos makes both classes weigh the same in the loss.
    pos_weight = n_neg / n_pos if params.class_weights else 1.0
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.seed)
        model = MLPRouter(ls.hidden_size, params.dropout)
        opt = torch.optim.AdamW(model.parameters(), lr=params.lr, weight_decay=params.weight_decay)
        gen = torch.Generator().manual_seed(params.seed)
        best = (math.inf, 0, copy.deepcopy(model.state_dict()), {})
        curves: list[dict[str, float]] = []
        bad_epochs = 0
        for epoch in progress(range(1, params.epochs + 1), desc="router", total=params.epochs, unit="epoch"):
            model.train()
            perm = torch.randperm(len(x_tr), generator=gen)
            total, count = 0.0, 0
            for s in range(0, len(perm), params.batch_size):
                idx = perm[s : s + params.batch_size]
                if len(idx) < 2:  # BatchNorm cannot normalise a batch of one
                    continue
                loss = loss_fn(model.logits(x_tr[idx]), y_tr[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                count += len(idx)
            ev = _evaluate(model, x_va, y_va, loss_fn, params.batch_size)
            curves.append({"epoch": epoch, "train_loss": total / max(count, 1), **ev})
            if ev["val_loss"] < best[0]:
                best = (ev["val_loss"], epoch, copy.deepcopy(model.state_dict()), ev)
                bad_epochs = 0
            else:
                bad_epochs += 1
                if bad_epochs >= params.patience:
                    break
    model.load_state_dict(best[2])
    model.eval()
    ev = best[3]
    metrics = RouterMetrics(
        val_loss=ev["val_loss"],
        val_auc=ev["val_auc"],
        val_accuracy=ev["val_accuracy"],
        val_ece=ev["val_ece"],
        label_balance=n_pos / len(y_tr),
        pos_weight=pos_weight,
        best_epoch=best[1],
        epochs_run=len(curves),
        n_train=len(tr),
        n_val=len(va),
        n_train_examples=int(ls.tokens["example_id"].iloc[tr].nunique()),
        n_val_examples=int(ls.tokens["example_id"].iloc[va].nunique()),
        curves=curves,
    )
    return model, metrics


# ----------------------------------------------------------------------------------------------------------------
# Storage and report


def save_router(router: MLPRouter, path: str | os.PathLike[str], meta: Mapping[str, Any]) -> Path:
    """``router.safetensors`` + ``router.json`` (hidden_size, dropout and the caller's meta), atomically."""
    info = dict(meta)
    info.update(hidden_size=router.hidden_size, dropout=router.dropout)
    state = {k: v.detach().contiguous().cpu() for k, v in router.state_dict().items()}
    with atomic_dir(path) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return Path(path)


def router_meta(
    ls: LabelSet, metrics: RouterMetrics, *, slm: str | None = None, llm: str | None = None
) -> dict[str, Any]:
    """The ``router.json`` fields that identify the training data and result."""
    return {
        "slm": slm if slm is not None else ls.meta.get("slm", ""),
        "llm": llm if llm is not None else ls.meta.get("llm", ""),
        "iteration": ls.iteration,
        "citer_s": bool(ls.meta.get("citer_s", False)),
        "data_hash": labelset_hash(ls),
        "metrics": metrics.to_dict(),
    }


def _same_model(a: str, b: str) -> bool:
    return os.path.normpath(str(a)).rstrip("/") == os.path.normpath(str(b)).rstrip("/")


def load_router(
    path: str | os.PathLike[str], expected_hidden_size: int | None = None, expected_slm: str | None = None
) -> tuple[MLPRouter, dict[str, Any]]:
    """Load a saved router in eval mode with its meta; refuses a checkpoint for another SLM (hidden size or name)."""
    d = Path(path)
    meta = read_artifact_meta(d, (WEIGHTS_FILE, META_FILE), META_FILE, RouterError, "save_router")
    for key in ("hidden_size", "dropout"):
        if key not in meta:
            raise RouterError(f"{d / META_FILE}: field {key} missing")
    h = int(meta["hidden_size"])
    if expected_hidden_size is not None and h != expected_hidden_size:
        raise RouterError(
            f"{d / META_FILE}: field hidden_size={h} but the SLM's hidden size is {expected_hidden_size} "
            f"(router trained for SLM {meta.get('slm')!r})"
        )
    if expected_slm is not None and not _same_model(meta.get("slm", ""), expected_slm):
        raise RouterError(
            f"{d / META_FILE}: field slm={meta.get('slm')!r} but the SLM in use is {expected_slm!r}"
        )
    model = MLPRouter(h, float(meta["dropout"]))
    try:
        model.load_state_dict(load_file(str(d / WEIGHTS_FILE)))
    except RuntimeError as exc:
        raise RouterError(f"{d / WEIGHTS_FILE}: weights do not fit hidden_size={h} ({exc})") from exc
    return model.eval(), meta


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
