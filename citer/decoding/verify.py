"""Verified routing: the LLM's catch-up call checks the SLM's tokens it reads anyway, and takes back the first bad one.

Every LLM call in routed decoding feeds the LLM every token of the row it has not seen (the catch-up), so it computes
the LLM's next-token distribution at each of them. A :class:`Verification` reads those distributions:

- **ρ (rho).** At the first SLM-written, not yet verified token ``y`` (at its seq index ``t``) where the LLM's own
  choice at ``t`` differs from ``y`` and ``-log p_LLM(y) > ρ``, the row is cut: ``y`` and everything after it are
  taken back, the LLM's choice is emitted in its place, and both caches rewind to ``t`` -- the state the row would
  have had if the router had sent step ``t`` to the LLM in the first place (the SLM then redoes the rest). ``ρ = ∞``
  checks nothing: plain CITER. ``ρ = 0`` takes every token where the LLM's choice differs (greedy: a lossless
  speculative decoder).
  Sampled rows use the same rule with the LLM's *sampled* choice, drawn with the key the row would have used at that
  step (its ``row_id`` and the token's index), so a replacement is exactly the token the LLM would have written.
- **W (window).** A row holding ``W`` unverified SLM tokens calls the LLM anyway, even when the router would let the
  SLM write (a *check* call: nothing is forced; the SLM's proposal for this step is verified in the same call and
  kept when it passes). ``W = 0``: no window. With the router off and ``W = k`` this is a lossy speculative decoder.
- **final.** A row about to finish (its SLM proposal is EOS or its last budgeted token) with anything unverified makes
  a check call first, so no unverified token ends an answer.

Until verified, an SLM token is *provisional*: the session holds its :class:`~citer.decoding.session.Emitted` back
and releases it once a call has checked it (or the row finishes), so callers and streams only see final tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch


class VerificationError(ValueError):
    """Bad verification settings."""


@dataclass(frozen=True)
class Verification:
    """``rho`` >= 0 (``math.inf`` = off), ``window`` >= 0 (0 = off), ``final``: check before a row finishes."""

    rho: float = math.inf
    window: int = 0
    final: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rho, bool) or not isinstance(self.rho, int | float) or not self.rho >= 0:
            raise VerificationError(f"verify_rho must be a number >= 0 (inf = off), got {self.rho!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise VerificationError(f"verify_window must be an integer >= 0, got {self.window!r}")
        if not isinstance(self.final, bool):
            raise VerificationError(f"verify_final must be true or false, got {self.final!r}")
        if self.rho == math.inf and (self.window or self.final):
            raise VerificationError(
                "verify_window/verify_final need a finite verify_rho: with rho = inf a check accepts every token"
            )

    @property
    def on(self) -> bool:
        return self.rho < math.inf

    def wants_check(self, unverified: int, finishing: bool) -> bool:
        """Whether a row the router lets the SLM continue calls the LLM anyway (``unverified``: its SLM tokens not
        yet checked; ``finishing``: its proposal would end it)."""
        if not self.on:
            return False
        return bool(self.window and unverified >= self.window) or (self.final and finishing)

    def engine_kwargs(self) -> dict[str, float | int | bool]:
        """The :class:`~citer.decoding.engine.RoutedEngine` keyword arguments that rebuild this setting."""
        return {"verify_rho": self.rho, "verify_window": self.window, "verify_final": self.final}

    def tags(self) -> dict[str, str]:
        """As a registered version records it (strings; ``inf`` spelled out)."""
        return {
            "verify_rho": "inf" if self.rho == math.inf else repr(float(self.rho)),
            "verify_window": str(self.window),
            "verify_final": "true" if self.final else "false",
        }

    @classmethod
    def from_tags(cls, tags: Mapping[str, object]) -> Verification:
        """The setting a version's tags (or a model config) record; none recorded: plain CITER."""
        rho = tags.get("verify_rho")
        final = tags.get("verify_final", False)
        try:
            return cls(
                math.inf if rho is None or str(rho) == "inf" else float(str(rho)),
                int(str(tags.get("verify_window", 0))),
                final if isinstance(final, bool) else str(final).lower() == "true",
            )
        except ValueError as exc:
            raise VerificationError(f"verification tags {dict(tags)!r}: {exc}") from exc


def first_cuts(
    logprobs: torch.Tensor, proposed: list[int], choice: list[int], owner: list[int], rho: float, n_rows: int
) -> list[int]:
    """Per row, the index (into the flat candidate list) of its first rejected candidate, -1 when all pass.

    logprobs (N, V): the LLM's log-distribution at each candidate position, candidates of a row contiguous and in
    order; ``proposed[n]``: the token there (-1: none, the LLM writes it -- always "rejected"); ``choice[n]``: the
    LLM's own token; ``owner[n]``: the candidate's row."""
    prop = torch.tensor([max(p, 0) for p in proposed], dtype=torch.long, device=logprobs.device)
    nll = (-logprobs.gather(1, prop[:, None])[:, 0]).tolist()  # (N,)
    out = [-1] * n_rows
    for n, (row, y, c) in enumerate(zip(owner, proposed, choice, strict=True)):
        if out[row] >= 0:
            continue
        if y < 0 or (c != y and nll[n] > rho):
            out[row] = n
    return out
