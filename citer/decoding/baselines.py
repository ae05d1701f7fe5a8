"""The router interface and the baseline routers (always-SLM, always-LLM, random, confidence).

A router is any callable ``hidden (B, H) float32 -> scores (B,)`` in [0, 1] = P(the SLM is good enough); the engine
sends rows whose score is below tau to the LLM. A router whose ``__call__`` (or ``forward``) has a parameter named
``row_ids`` also receives ``row_ids`` and ``steps`` (both (B,) int64: the row's index in the caller's prompt list and
the index of the token being decided), so its decisions can be independent of how rows are batched.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from citer.decoding.sampling import STREAM_ROUTER, counter_uniform

Router = Callable[..., torch.Tensor]


def wants_row_ids(router: Callable[..., torch.Tensor]) -> bool:
    """True when the router declares a ``row_ids`` parameter (nn.Module: on ``forward``)."""
    target = router.forward if isinstance(router, nn.Module) else router
    try:
        return "row_ids" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def router_read_bytes(router: Router, slm: nn.Module | None = None) -> int:
    """Bytes a router reads per decoding step beyond the SLM's own weights: its ``weight_bytes`` attribute when it
    declares one, else the bytes of its parameters that the SLM does not hold (a confidence router reads the SLM's
    head, already read by the SLM step: 0). Callables without parameters read nothing."""
    declared = getattr(router, "weight_bytes", None)
    if declared is not None:
        return int(declared)
    if not isinstance(router, nn.Module):
        return 0
    shared = {p.data_ptr() for p in slm.parameters()} if slm is not None else set()
    own = {p.data_ptr(): p for p in router.parameters() if p.data_ptr() not in shared}
    return int(sum(p.numel() * p.element_size() for p in own.values()))


class AlwaysSLM:
    """Every token from the SLM (score 1)."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)


class AlwaysLLM:
    """Every token from the LLM (score 0; routes to the LLM for any tau > 0)."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)


class RandomRouter:
    """Sends a token to the LLM with probability ``p`` (score 0, else 1), decided by (seed, row id, step) only."""

    def __init__(self, p: float, seed: int = 0) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomRouter: p must lie in [0, 1], got {p}")
        self.p = p
        self.seed = seed

    def __call__(
        self, hidden: torch.Tensor, row_ids: torch.Tensor | None = None, steps: torch.Tensor | None = None
    ) -> torch.Tensor:
        if row_ids is None or steps is None:
            raise ValueError("RandomRouter needs row_ids and steps (the engine passes them)")
        u = counter_uniform(self.seed, STREAM_ROUTER, row_ids, steps)  # (B,)
        return (u >= self.p).to(torch.float32).to(hidden.device)


class ConfidenceRouter(nn.Module):
    """BiLD-style: the SLM's own confidence as the score, so low-confidence tokens go to the LLM.

    Holds the SLM's output head to turn hidden states into a distribution, which keeps the (B, H) interface.
    ``kind="max_prob"``: the top probability; ``kind="entropy"``: 1 - H(p) / log(V). ``vocab_size`` (the
    tokenizer's) cuts a padded head's extra rows out of the distribution; None keeps the head's width.
    """

    def __init__(
        self,
        lm_head: nn.Module,
        kind: Literal["max_prob", "entropy"] = "max_prob",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("max_prob", "entropy"):
            raise ValueError(f"ConfidenceRouter: kind must be 'max_prob' or 'entropy', got {kind!r}")
        self.lm_head = lm_head
        self.kind = kind
        self.vocab_size = vocab_size

    @classmethod
    def from_model(
        cls, slm: nn.Module, kind: Literal["max_prob", "entropy"] = "max_prob", vocab_size: int | None = None
    ) -> ConfidenceRouter:
        return cls(slm.get_output_embeddings(), kind, vocab_size)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        logits = self.lm_head(hidden.to(device=w.device, dtype=w.dtype)).float()[
            :, : self.vocab_size
        ]  # (B, V)
        logp = torch.log_softmax(logits, dim=-1)
        if self.kind == "max_prob":
            return logp.max(dim=-1).values.exp()  # (B,)
        ent = -(logp.exp() * logp).sum(dim=-1)  # (B,)
        return (1.0 - ent / math.log(logits.shape[-1])).clamp(0.0, 1.0)
