"""Thresholds from target LLM fractions: each router's τ is a quantile of its own scores on dev.

Routers put their scores on different scales (a trained MLP, the SLM's top probability, a query classifier), so one
hand-made τ grid spans very different costs per method. Instead every threshold method is asked for the same
fractions of tokens sent to the LLM: τ_f is the f-quantile of the router's scores at the positions where it decides
on dev. Those positions are taken from the SLM's own greedy answers (what the router reads while the SLM writes);
a routed answer visits slightly different positions, so the realised fraction on test is reported beside the target.
The SLM that scores them is the one that decodes: the torch model, or the runner's own (llama.cpp's kernels at the
precision that serves, :func:`decision_hidden_on`), whose hidden states differ from float32 torch's.

A version's quantile table (:func:`quantile_table`) is a file logged with it in the registry, so ``route``/``serve``
can be asked for a fraction instead of a raw τ (:func:`tau_for_fraction`, via :mod:`citer.tracking.deployed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from citer.decoding.baselines import Router, wants_row_ids
from citer.decoding.padding import right_padded
from citer.evaluation.passes import batches

QUANTILE_POINTS = 101  # fractions 0.00, 0.01, ..., 1.00


@torch.no_grad()
def decision_hidden(
    slm: Any,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
) -> list[torch.Tensor]:
    """Per example, (T_i, H) the SLM's last hidden state at each position where a router decides the next token of
    ``outputs[i]`` (teacher-forced over prompt + output: position len(prompt) - 1 + t decides token t)."""
    dev = next(slm.parameters()).device
    decoder = slm.get_decoder()
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for idx in batches(prompts, batch_size):
        seqs = answer_positions(prompts, outputs, idx)[0]
        ids, mask = right_padded(seqs, pad_id)  # (B, T)
        hidden = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state  # (B, T, H)
        for r, i in enumerate(idx):
            start = len(prompts[i]) - 1
            out[i] = hidden[r, start : start + len(outputs[i])].float()  # (T_i, H)
    return out


def answer_positions(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], idx: Sequence[int]
) -> tuple[list[list[int]], list[int], list[int]]:
    """For examples ``idx``: the texts prompt + answer (its last token dropped: it decides nothing) and the
    (row, position) pairs where each answer token is decided (position len(prompt) - 1 + t decides token t), in
    example then token order."""
    seqs = [list(prompts[i]) + list(answers[i])[:-1] for i in idx]
    rows: list[int] = []
    pos: list[int] = []
    for r, i in enumerate(idx):
        start = len(prompts[i]) - 1
        rows += [r] * len(answers[i])
        pos += range(start, start + len(answers[i]))
    return seqs, rows, pos


@torch.no_grad()
def decision_hidden_on(
    engine: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], batch_size: int
) -> list[torch.Tensor]:
    """:func:`decision_hidden` on an engine's own SLM (``engine.positions``, e.g. llama.cpp's kernels at the
    precision that serves), so τ is a quantile of the scores the router will read there."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for idx in batches(prompts, batch_size):
        seqs, rows, pos = answer_positions(prompts, outputs, idx)
        if not rows:
            continue
        _, hidden = engine.positions("slm", seqs, rows, pos)  # (n, H)
        assert hidden is not None, "the engine's SLM returns no hidden states"
        for i, h in zip(idx, hidden.float().split([len(outputs[i]) for i in idx]), strict=True):
            out[i] = h  # (T_i, H)
    return out


@torch.no_grad()
def router_scores(router: Router, hidden: Sequence[torch.Tensor]) -> np.ndarray:
    """Every decision position's score, all examples concatenated (routers keyed by row/step get both)."""
    if isinstance(router, torch.nn.Module):
        router.eval()
    parts = []
    for i, h in enumerate(hidden):
        if h.shape[0] == 0:
            continue
        if wants_row_ids(router):
            rid = torch.full((h.shape[0],), i, dtype=torch.long, device=h.device)
            steps = torch.arange(h.shape[0], device=h.device)
            s = router(h, row_ids=rid, steps=steps)
        else:
            s = router(h)
        parts.append(s.reshape(-1).float().cpu().numpy())
    return np.concatenate(parts) if parts else np.zeros(0)


def tau_at_fraction(scores: np.ndarray, fraction: float) -> float:
    """The τ that sends ``fraction`` of ``scores`` to the LLM (score < τ): midway between the k-th and (k+1)-th
    smallest score, k = round(fraction x n); in [0, 1]."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    n = len(s)
    if n == 0:
        raise ValueError("no scores to take a quantile of")
    k = int(round(float(fraction) * n))
    if k <= 0:
        return float(max(0.0, min(1.0, s[0])))
    if k >= n:
        return float(min(1.0, np.nextafter(s[-1], np.inf)))
    return float(min(1.0, max(0.0, (s[k - 1] + s[k]) / 2)))


def taus_at_fractions(scores: np.ndarray, fractions: Sequence[float]) -> list[tuple[float, float]]:
    """``[(fraction, τ), ...]`` for each fraction; fractions whose τ repeats an earlier one are dropped (one pass)."""
    out: list[tuple[float, float]] = []
    seen: set[float] = set()
    for f in fractions:
        tau = tau_at_fraction(scores, f)
        if tau not in seen:
            seen.add(tau)
            out.append((float(f), tau))
    return out


def quantile_table(scores: np.ndarray) -> list[float]:
    """τ at fractions 0, 0.01, ..., 1 of these scores (stored with a registered version)."""
    return [round(tau_at_fraction(scores, f), 6) for f in np.linspace(0.0, 1.0, QUANTILE_POINTS)]


def tau_for_fraction(table: Sequence[float], fraction: float) -> float:
    """τ for a target LLM-token fraction from a :func:`quantile_table` (linear between its points)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"llm_fraction must lie in [0, 1], got {fraction}")
    if len(table) < 2:
        raise ValueError("the version has no dev score quantiles (registered before fractions were recorded)")
    xs = np.linspace(0.0, 1.0, len(table))
    return float(np.interp(fraction, xs, np.asarray(table, dtype=np.float64)))


def method_scores(
    slm: Any,
    routers: Mapping[str, Router],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
    engine: Any | None = None,
) -> dict[str, np.ndarray]:
    """Each router's scores at the decision positions of the SLM's own answers (one SLM pass for all routers); on
    ``engine``'s SLM (:func:`decision_hidden_on`) where given, else on the torch ``slm``."""
    hidden = (
        decision_hidden(slm, prompts, outputs, batch_size, pad_id)
        if engine is None
        else decision_hidden_on(engine, prompts, outputs, batch_size)
    )
    return {name: router_scores(r, hidden) for name, r in routers.items()}
