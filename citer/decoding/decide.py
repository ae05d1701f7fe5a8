"""The routing decision of a step, written once: the router's scores, the rule that sends a row to the LLM (score
below τ), and the token the SLM proposes. A captured or compiled step traces :func:`decide` inside its graph, the
session runs :func:`route` and the sampler eagerly where the graph could not, and teacher-forced scoring runs
:func:`route` alone; so a router decides the same way wherever it runs.

Shapes: b = rows, H = hidden, V = the model's (possibly padded) vocabulary, cut to the shared one before a choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from citer.decoding.pairing import cut_logits
from citer.decoding.sampling import select_tokens

Sampling = tuple[float, float, int]  # temperature, top_p, seed


def router_scores(
    router: Callable[..., torch.Tensor],
    takes_rows: bool,
    hidden: torch.Tensor,
    rid: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """The router's scores (b,) for hidden (b, H); ``takes_rows``: the router keys its draw on ``row_ids``/``steps``
    (b,) (a random router), moved to the hidden state's device."""
    if takes_rows:
        dev = hidden.device
        scores = router(hidden.float(), row_ids=rid.to(dev), steps=steps.to(dev))
    else:
        scores = router(hidden.float())
    scores = scores.reshape(-1)
    if scores.shape[0] != hidden.shape[0]:
        raise ValueError(f"router returned {tuple(scores.shape)} scores for {hidden.shape[0]} rows")
    return scores


def route(
    router: Callable[..., torch.Tensor],
    takes_rows: bool,
    tau: float,
    hidden: torch.Tensor,
    rid: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """The hard flags (b,) bool: True where the router's score falls below ``tau`` and the LLM writes the token."""
    return router_scores(router, takes_rows, hidden, rid, steps) < tau


@dataclass(frozen=True)
class Decision:
    """What a step's decision reads besides the model: the router (``takes_rows``: it keys draws on row ids), τ,
    the shared vocabulary and the rows' one sampling setting (temperature, top_p, seed). One object per (engine,
    sampling): a capture records the decision of one object."""

    router: Callable[..., torch.Tensor]
    takes_rows: bool
    tau: float
    vocab_size: int
    sampling: Sampling


def decide(
    logits: torch.Tensor, hidden: torch.Tensor, rid: torch.Tensor, steps: torch.Tensor, d: Decision
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's decision for rows that sample alike, in tensor ops only (no host read, no shape from data,
    so it traces into a captured step): the proposed tokens (b,) long and the hard flags (b,) bool. logits (b, V),
    hidden (b, H), rid/steps (b,) key each row's draws."""
    hard = route(d.router, d.takes_rows, d.tau, hidden, rid, steps)
    t, p, seed = d.sampling
    return select_tokens(cut_logits(logits, d.vocab_size), t, p, seed, rid, steps), hard
