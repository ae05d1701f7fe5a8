"""Query-level routing (RouteLLM's recipe): one model answers each whole question, chosen from the prompt.

Trained like RouteLLM's routers, on per-question labels: on train questions, does the SLM alone answer correctly?
A logistic classifier reads the SLM's mean last hidden state over the prompt (the prefill the SLM runs anyway) and
predicts P(SLM correct). Like every method its thresholds come from dev (the question fraction sent to the LLM).

It costs no decoding pass of its own: each question's outcome is picked from the SLM-only or the LLM-only pass. A
question sent to the LLM still paid the SLM prefill that scored it (and the classifier's read), charged to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from citer.config import QueryRouterParams
from citer.decoding.cost import CostMeter, ModelCost
from citer.decoding.padding import right_padded
from citer.evaluation.passes import PassResult, batches
from citer.evaluation.pricing import CallCounts


@torch.no_grad()
def prompt_features(slm: Any, prompts: Sequence[Sequence[int]], batch_size: int, pad_id: int) -> torch.Tensor:
    """(N, H) the SLM's mean last hidden state over each prompt's positions."""
    dev = next(slm.parameters()).device
    out = torch.empty(len(prompts), slm.config.get_text_config(decoder=True).hidden_size)
    decoder = slm.get_decoder()
    for idx in batches(prompts, batch_size):
        ids, mask = right_padded([prompts[i] for i in idx], pad_id)  # (B, T)
        hidden = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state.float()
        m = mask.to(hidden.device, torch.float32).unsqueeze(-1)  # (B, T, 1)
        mean = (hidden * m).sum(1) / m.sum(1)  # (B, H)
        for r, i in enumerate(idx):
            out[i] = mean[r].cpu()
    return out


@dataclass
class QueryRouter:
    """P(the SLM alone answers correctly) = sigmoid(w · standardise(features) + b)."""

    mean: torch.Tensor  # (H,)
    std: torch.Tensor  # (H,)
    weight: torch.Tensor  # (H,)
    bias: float

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        z = (features.float() - self.mean) / self.std
        return torch.sigmoid(z @ self.weight + self.bias)  # (N,)

    @property
    def weight_bytes(self) -> int:
        return int(4 * (3 * self.weight.numel() + 1))


def train_query_router(
    features: torch.Tensor, slm_correct: Sequence[bool], params: QueryRouterParams, seed: int
) -> QueryRouter:
    """Class-balanced, L2-regularised logistic regression (full-batch Adam, seeded) on standardised features."""
    y = torch.tensor([float(c) for c in slm_correct])
    if len(y) != features.shape[0]:
        raise ValueError(f"{features.shape[0]} feature rows for {len(y)} labels")
    mean = features.mean(0)
    std = features.std(0).clamp_min(1e-6)
    x = (features.float() - mean) / std
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(x.shape[1], generator=g) * 0.01).requires_grad_(True)
    b = torch.zeros((), requires_grad=True)
    pos = float(y.sum())
    neg = float(len(y) - pos)
    # Balanced weights: the SLM is right on a minority of questions in most pairs; unweighted, the classifier says no.
    sample_w = torch.where(y > 0, len(y) / (2 * max(pos, 1.0)), len(y) / (2 * max(neg, 1.0)))
    opt = torch.optim.Adam([w, b], lr=params.lr, weight_decay=params.weight_decay)
    for _ in range(params.epochs):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y, weight=sample_w)
        loss.backward()
        opt.step()
    return QueryRouter(mean, std, w.detach(), float(b.detach()))


def combine_query(
    slm_res: PassResult,
    llm_res: PassResult,
    to_llm: Sequence[bool],
    extra_bytes: Sequence[float],
    bandwidth: float,
) -> PassResult:
    """Per question, the SLM-only or the LLM-only outcome; ``extra_bytes`` (the SLM's prompt scoring, charged to
    questions sent to the LLM) joins the bytes. Wall time: each pass's time per token x the tokens taken from it."""
    pick = [llm_res if m else slm_res for m in to_llm]
    n = len(to_llm)

    def per_tok(p: PassResult) -> float:
        return p.wall_seconds / max(sum(p.n_tokens), 1)

    byts = [pick[i].bytes_moved[i] + extra_bytes[i] for i in range(n)]
    batch = [pick[i].batch_bytes[i] + extra_bytes[i] for i in range(n)] if slm_res.batch_bytes else []
    return PassResult(
        [pick[i].correct[i] for i in range(n)],
        [pick[i].n_tokens[i] for i in range(n)],
        [pick[i].llm_tokens[i] for i in range(n)],
        [pick[i].llm_calls[i] for i in range(n)],
        byts,
        sum(per_tok(p) * p.n_tokens[i] for i, p in enumerate(pick)),
        sum(byts) / bandwidth,
        [pick[i].tokens[i] for i in range(n)],
        batch,
    )


def scoring_bytes(
    slm: Any, prompts: Sequence[Sequence[int]], extra_weight_bytes: int, gpu: str
) -> list[float]:
    """Per question, the bytes of the SLM prefill that computes the query router's input plus the classifier's read,
    as if the question were scored alone (batch 1, like every method's bytes)."""
    meter = CostMeter(ModelCost.from_model(slm).plus(extra_weight_bytes), None, len(prompts), gpu)
    for i, p in enumerate(prompts):
        meter.forward("slm", [i], [len(p)], [len(p)])
    rows, _ = meter.finish(0.0)
    return [r.bytes_alone for r in rows]


def query_counts(
    slm_res: PassResult, llm_res: PassResult, to_llm: Sequence[bool], prompts: Sequence[Sequence[int]]
) -> list[CallCounts]:
    """Per question, the calls :func:`combine_query` and :func:`scoring_bytes` charge: the pass it takes, plus for a
    question sent to the LLM the SLM prefill that scored it (its KV read and written) and the classifier's read."""
    return [
        (llm_res if m else slm_res).counts[i] + (CallCounts(1, 2 * len(p), 0, 0, 1) if m else CallCounts())
        for i, (m, p) in enumerate(zip(to_llm, prompts, strict=True))
    ]


def query_decisions(scores: np.ndarray, tau: float) -> list[bool]:
    """Questions whose P(SLM correct) is below τ go to the LLM."""
    return [bool(s < tau) for s in np.asarray(scores)]
