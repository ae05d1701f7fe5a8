"""The MLP router of CITER: the SLM's hidden state -> P(the SLM's token is good enough).

Architecture as in the paper: ``h -> 2h -> h -> 1`` with BatchNorm, ReLU and dropout after both hidden layers, then a
sigmoid; h is the SLM's hidden size. The input is the hidden state (D = h) or, with ``router.features``, the hidden
state plus features computed from it (:mod:`citer.routing.features`, D > h). Trained with BCE on "SLM preferred"
labels, validation split by example (tokens of one example are highly correlated, so a token-level split would leak),
early stopping on validation loss that keeps the best epoch. Metrics and the report live in
:mod:`citer.routing.metrics` (re-exported here); other widths (``router.layers``) in :mod:`citer.routing.architecture`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from citer.config import RouterParams
from citer.ops.io import atomic_dir, read_artifact_meta
from citer.ops.progress import progress
from citer.routing.architecture import MLPRouter, layer_widths
from citer.routing.features import (
    DEFAULT_LOGIT_K,
    HIDDEN_ONLY,
    FeatureRouter,
    RouterError,
    feature_matrix,
    head_vocab,
    input_dim,
    normalize_features,
    slm_parts,
)
from citer.routing.label_store import LabelSet, labelset_hash
from citer.routing.metrics import (
    REPORT_KEYS,
    RouterMetrics,
    expected_calibration_error,
    iteration_summary,
    roc_auc,
    write_router_report,
)

__all__ = [
    "REPORT_KEYS",
    "FeatureRouter",
    "MLPRouter",
    "RouterError",
    "RouterMetrics",
    "expected_calibration_error",
    "iteration_summary",
    "load_router",
    "roc_auc",
    "router_meta",
    "save_router",
    "split_by_example",
    "train_router",
    "write_router_report",
]

WEIGHTS_FILE = "router.safetensors"
META_FILE = "router.json"


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
    model: MLPRouter, x: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, bs: int
) -> dict[str, float]:
    model.eval()
    logits = torch.cat([model.logits(x[rows[s : s + bs]]) for s in range(0, len(rows), bs)])  # (n,)
    loss = float(loss_fn(logits, y))
    prob = torch.sigmoid(logits).numpy()
    yn = y.numpy()
    return {
        "val_loss": loss,
        "val_auc": roc_auc(yn, prob),
        "val_accuracy": float(((prob >= 0.5) == (yn >= 0.5)).mean()),
        "val_ece": expected_calibration_error(yn, prob),
    }


def _inputs(
    ls: LabelSet, params: RouterParams, slm: Any, vocab_size: int | None
) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """Training inputs (N, D) float32 in table order, and (head, embedding, features, k, vocab) for features."""
    if not torch.isfinite(ls.hidden).all():
        raise RouterError("label set: field hidden contains NaN or inf")
    feats = normalize_features(params.features)
    if feats == HIDDEN_ONLY:
        return ls.hidden_for_rows(), None
    if slm is None:
        raise RouterError(
            f"router: field features={list(feats)} are computed with the SLM's head and embedding; pass slm="
        )
    if int(slm.config.hidden_size) != ls.hidden_size:
        raise RouterError(
            f"label set: field hidden has size {ls.hidden_size}, the SLM's is {int(slm.config.hidden_size)}"
        )
    head, emb = slm_parts(slm)
    vocab = head_vocab(head, vocab_size)
    rows = torch.as_tensor(ls.tokens["row"].to_numpy().copy(), dtype=torch.long)
    x = feature_matrix(ls.hidden, rows, feats, head, emb, vocab, params.logit_k)
    if not torch.isfinite(x).all():
        raise RouterError(f"router: features {list(feats)} of the label set contain NaN or inf")
    return x, (head, emb, feats, params.logit_k, vocab)


def train_router(
    ls: LabelSet, params: RouterParams, slm: Any = None, vocab_size: int | None = None
) -> tuple[MLPRouter | FeatureRouter, RouterMetrics]:
    """Fit the router on ``ls``; returns it in eval mode with the best epoch's weights.

    With ``params.features`` beyond ``hidden`` the inputs are computed from the label set's hidden states with
    ``slm``'s head and input embedding (required) over the tokenizer's ``vocab_size`` ids (default: the head's
    rows), and the result is a :class:`FeatureRouter` on ``slm``; otherwise an :class:`MLPRouter` as before.
    """
    _check_trainable(ls)
    x_all, extra = _inputs(ls, params, slm, vocab_size)  # (N, D) float32, table order
    y_all = torch.as_tensor(ls.tokens["label"].to_numpy().copy(), dtype=torch.float32)  # (N,)
    tr, va = split_by_example(ls.tokens["example_id"].tolist(), params.val_fraction, params.seed)
    # Batches index x_all: no train/validation copies of the (N, D) inputs.
    tr_rows, va_rows = torch.as_tensor(tr, dtype=torch.long), torch.as_tensor(va, dtype=torch.long)
    y_tr, y_va = y_all[tr_rows], y_all[va_rows]
    n_pos = float(y_tr.sum())
    n_neg = float(len(y_tr) - n_pos)
    if n_pos == 0 or n_neg == 0:
        raise RouterError("label set: the training split holds one class only; use more examples")
    # pos_weight = n_neg / n_pos makes both classes weigh the same in the loss.
    pos_weight = n_neg / n_pos if params.class_weights else 1.0
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.seed)
        widths = layer_widths(params.layers, ls.hidden_size)
        model = MLPRouter(ls.hidden_size, params.dropout, input_dim=x_all.shape[1], widths=widths)
        # foreach (multi-tensor ops; PyTorch's default on CUDA only): bitwise the per-tensor loop's router, faster
        opt = torch.optim.AdamW(model.parameters(), params.lr, weight_decay=params.weight_decay, foreach=True)
        gen = torch.Generator().manual_seed(params.seed)
        best = (math.inf, 0, copy.deepcopy(model.state_dict()), {})
        curves: list[dict[str, float]] = []
        bad_epochs = 0
        for epoch in progress(range(1, params.epochs + 1), desc="router", total=params.epochs, unit="epoch"):
            model.train()
            perm = torch.randperm(len(tr_rows), generator=gen)
            total, count = 0.0, 0
            for s in range(0, len(perm), params.batch_size):
                idx = perm[s : s + params.batch_size]
                if len(idx) < 2:  # BatchNorm cannot normalise a batch of one
                    continue
                loss = loss_fn(model.logits(x_all[tr_rows[idx]]), y_tr[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                count += len(idx)
            ev = _evaluate(model, x_all, va_rows, y_va, loss_fn, params.batch_size)
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
    if extra is None:
        return model, metrics
    head, emb, feats, k, vocab = extra
    return FeatureRouter(model, head, emb, feats, k, vocab).eval(), metrics


# ----------------------------------------------------------------------------------------------------------------
# Storage and report


def require_quality(metrics: RouterMetrics, min_val_auc: float, what: str) -> None:
    """Refuse a router whose validation AUC is below ``min_val_auc`` (``router.min_val_auc``; 0 disables the gate),
    before anything is written: the previous router stays."""
    auc = float(metrics.val_auc)
    if min_val_auc > 0 and not auc >= min_val_auc:  # NaN (one class in validation) fails too
        raise RouterError(
            f"{what}: validation AUC {auc:.3f} is below router.min_val_auc={min_val_auc}; not written (the previous "
            "router stays). More or better labels, or another learning rate, usually help"
        )


def save_router(
    router: MLPRouter | FeatureRouter, path: str | os.PathLike[str], meta: Mapping[str, Any]
) -> Path:
    """``router.safetensors`` (the MLP's weights) + ``router.json`` (hidden_size, dropout, input_dim, widths,
    features, logit_k, vocab_size for a feature router, and the caller's meta), atomically."""
    mlp = router.mlp if isinstance(router, FeatureRouter) else router
    info = dict(meta)
    info.update(
        hidden_size=mlp.hidden_size, dropout=mlp.dropout, input_dim=mlp.input_dim, widths=list(mlp.widths)
    )
    if isinstance(router, FeatureRouter):
        info.update(router.describe())
    else:
        info.update(features=list(HIDDEN_ONLY), logit_k=DEFAULT_LOGIT_K)
    state = {k: v.detach().contiguous().cpu() for k, v in mlp.state_dict().items()}
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


def _read_inputs(d: Path, meta: Mapping[str, Any], h: int) -> tuple[tuple[str, ...], int, int]:
    """(features, logit_k, input_dim) a router.json records; one without ``features`` reads the hidden state."""
    try:
        feats = normalize_features(meta.get("features", HIDDEN_ONLY))
        k = int(meta.get("logit_k", DEFAULT_LOGIT_K))
        want = input_dim(h, feats, k)
    except (RouterError, TypeError, ValueError) as exc:
        raise RouterError(f"{d / META_FILE}: {exc}") from exc
    d_in = int(meta.get("input_dim", want))
    if d_in != want:
        raise RouterError(f"{d / META_FILE}: field input_dim={d_in} but features {list(feats)} give {want}")
    return feats, k, d_in


def load_router(
    path: str | os.PathLike[str],
    expected_hidden_size: int | None = None,
    expected_slm: str | None = None,
    slm: Any = None,
    vocab_size: int | None = None,
) -> tuple[MLPRouter | FeatureRouter, dict[str, Any]]:
    """Load a saved router in eval mode with its meta; refuses a checkpoint for another SLM (hidden size or name).

    A router on the hidden state alone is an :class:`MLPRouter` on the CPU (``slm`` is not needed). One on more
    features needs ``slm`` (its head and input embedding, shared) and comes back as a :class:`FeatureRouter` on the
    head's device; ``vocab_size`` defaults to the one it was trained with and must match it when given.
    """
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
    feats, k, d_in = _read_inputs(d, meta, h)
    if feats != HIDDEN_ONLY and slm is None:
        raise RouterError(
            f"{d}: router reads features {list(feats)} computed with the SLM's head and embedding; "
            "pass slm= (and vocab_size=) to load_router"
        )
    widths = meta.get("widths")  # routers saved before the width grid: the paper's (2h, h)
    try:
        model = MLPRouter(h, float(meta["dropout"]), input_dim=d_in, widths=widths)
    except (TypeError, ValueError) as exc:
        raise RouterError(f"{d / META_FILE}: field widths={widths!r} is not a list of sizes ({exc})") from exc
    try:
        model.load_state_dict(load_file(str(d / WEIGHTS_FILE)))
    except SafetensorError as exc:  # truncated or overwritten: name the file, not just the reader's complaint
        raise RouterError(f"{d / WEIGHTS_FILE}: not a readable safetensors file ({exc})") from exc
    except RuntimeError as exc:
        raise RouterError(
            f"{d / WEIGHTS_FILE}: weights do not fit hidden_size={h}, input_dim={d_in}, widths={list(model.widths)} "
            f"({exc})"
        ) from exc
    if feats == HIDDEN_ONLY:
        return model.eval(), meta
    if int(slm.config.hidden_size) != h:
        raise RouterError(
            f"{d / META_FILE}: field hidden_size={h} but the SLM's is {int(slm.config.hidden_size)}"
        )
    recorded = meta.get("vocab_size")
    if vocab_size is not None and recorded is not None and int(vocab_size) != int(recorded):
        raise RouterError(
            f"{d / META_FILE}: field vocab_size={recorded} but vocab_size={vocab_size} was given"
        )
    head, emb = slm_parts(slm)
    try:
        router = FeatureRouter(model, head, emb, feats, k, vocab_size if vocab_size is not None else recorded)
    except RouterError as exc:
        raise RouterError(f"{d / META_FILE}: {exc}") from exc
    return router.to(head.weight.device).eval(), meta
