"""Query-level routing (RouteLLM-style): one model answers each whole question, chosen from the prompt.

It costs no decoding pass of its own: each question's outcome is picked from the SLM-only or the LLM-only pass by
the question's score, and the SLM prefill that computes the score is charged to the questions sent to the LLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from citer.config import SweepParams
from citer.decoding.baselines import Router
from citer.decoding.cost import GPU_BANDWIDTH, CostMeter, ModelCost
from citer.evaluation.passes import PassResult, batches, to_row
from citer.evaluation.rows import SweepRow

Log = Callable[[str], None]


@torch.no_grad()
def prompt_scores(
    slm: Any, router: Router, prompts: Sequence[Sequence[int]], batch_size: int, pad_id: int
) -> torch.Tensor:
    """(N,) the router's mean score over the SLM's hidden states at every prompt position."""
    dev = next(slm.parameters()).device
    out = torch.empty(len(prompts))
    decoder = slm.get_decoder()
    for idx in batches(prompts, batch_size):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)  # (B, T) right-padded
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(prompts[i])] = torch.tensor(list(prompts[i]))
            mask[r, : len(prompts[i])] = 1
        hidden = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state  # (B, T, H)
        valid = mask.bool().to(dev)
        scores = router(hidden[valid]).float().cpu()  # (n_valid,)
        per_row = torch.split(scores, mask.sum(1).tolist())
        for r, i in enumerate(idx):
            out[i] = per_row[r].mean()
    return out


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
    return PassResult(
        [pick[i].correct[i] for i in range(n)],
        [pick[i].n_tokens[i] for i in range(n)],
        [pick[i].llm_tokens[i] for i in range(n)],
        [pick[i].llm_calls[i] for i in range(n)],
        byts,
        sum(per_tok(p) * p.n_tokens[i] for i, p in enumerate(pick)),
        sum(byts) / bandwidth,
        [pick[i].tokens[i] for i in range(n)],
    )


def scoring_bytes(
    slm: Any, prompts: Sequence[Sequence[int]], batch_size: int, gpu: str, per_query: bool = True
) -> list[float]:
    """Per question, the bytes of the SLM prefill that computes the query router's input (same batches as
    :func:`prompt_scores`, metered by :class:`citer.decoding.cost.CostMeter`)."""
    meter = CostMeter(ModelCost.from_model(slm), None, len(prompts), gpu)
    for idx in batches(prompts, batch_size):
        lens = [len(prompts[i]) for i in idx]
        meter.forward("slm", idx, lens, lens)
    rows, _ = meter.finish(0.0)
    return [r.bytes_alone if per_query else r.bytes_moved for r in rows]


def query_rows(
    slm: Any,
    router: Router,
    prompts: Sequence[Sequence[int]],
    slm_res: PassResult,
    llm_res: PassResult,
    params: SweepParams,
    ex_hash: str,
    pad: int,
    say: Log,
) -> list[SweepRow]:
    """Query-level routing: the questions with the lowest mean router score over their prompt go to the LLM."""
    t0 = time.perf_counter()
    scores = prompt_scores(slm, router, prompts, params.batch_size, pad)  # (N,)
    extra = scoring_bytes(slm, prompts, params.batch_size, params.gpu, params.bytes_per == "query")
    secs = time.perf_counter() - t0
    n = len(prompts)
    order = sorted(range(n), key=lambda i: (float(scores[i]), i))
    out = []
    for q in params.query_llm_fractions:
        k = round(q * n)
        to_llm = [False] * n
        for i in order[:k]:
            to_llm[i] = True
        # The threshold that splits the sorted scores at k (midpoint; the ends are 0 and 1).
        lo = float(scores[order[k - 1]]) if k > 0 else 0.0
        hi = float(scores[order[k]]) if k < n else 1.0
        res = combine_query(
            slm_res,
            llm_res,
            to_llm,
            [extra[i] if to_llm[i] else 0.0 for i in range(n)],
            GPU_BANDWIDTH[params.gpu],
        )
        res.wall_seconds += secs * k / n  # scoring time of the questions sent to the LLM
        out.append(to_row("query", (lo + hi) / 2, res, llm_res, ex_hash, question_llm_fraction=k / n))
    say(f"sweep query: {len(out)} points from the SLM/LLM passes, scoring {secs:.1f}s")
    return out
