"""Verified routing in the sweep: ``citer_verify`` and ``bild``, every knob chosen on dev in stages.

- ``citer_verify``: the router variant the rule chose on dev (:data:`VARIANTS`: which inputs the router reads) with
  the catch-up's check (ρ), a window W and the final check (:mod:`citer.decoding.verify`).
- ``bild``: the training-free anchor (Kim et al. 2023, "Big Little Decoder"): the SLM's top probability triggers the
  LLM (the ``confidence`` router), with the same rollback.

Stages (``sweep.verify``, :class:`~citer.config.VerifySweepParams`): (1) dev, every ρ x fraction without a window;
(2) dev, at each method's best stage-1 point, every window and the final check flipped; the rule picks the point of
stage 1 or 2; (3) test, each method's fraction curve at its dev-chosen ρ, W and final check, so the frontier has a
curve and the chosen point is on it.
Thresholds come from each router's own dev scores, as for every threshold method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from citer.config import SelectionRule, VerifySweepParams
from citer.evaluation.plan import PassSpec
from citer.evaluation.promotion import best_row
from citer.evaluation.sweep_rows import SweepRow

VARIANTS = ("citer", "citer_emb", "citer_logits", "citer_emb_logits")  # the router-input choices made on dev


@dataclass(frozen=True)
class VerifyStages:
    """The staged grid of the verified methods. ``routers``: method -> router key it decodes with; ``taus``: router
    key -> [(fraction, τ)] at ``params.fractions`` from that router's dev scores."""

    params: VerifySweepParams
    routers: Mapping[str, str]
    taus: Mapping[str, Sequence[tuple[float, float]]]

    @property
    def methods(self) -> list[str]:
        return list(self.routers)

    def spec(
        self, tag: str, method: str, f: float, tau: float, rho: float, window: int, final: bool | None = None
    ) -> PassSpec:
        final = self.params.final if final is None else final
        eng = {"verify_rho": float(rho), "verify_window": int(window), "verify_final": final}
        return PassSpec(
            f"{tag} {method} f={f:g} rho={rho:g} W={window}{' final' if final else ''}",
            tag,
            method=method,
            router=self.routers[method],
            tau=tau,
            fraction=f,
            engine=eng,
        )

    def stage1(self) -> list[PassSpec]:
        """Dev: every ρ at every fraction, no window."""
        return [
            self.spec("dev", m, f, tau, rho, 0)
            for m in self.methods
            for rho in self.params.rhos
            for f, tau in self.taus[self.routers[m]]
        ]

    def stage2(self, dev_rows: Sequence[SweepRow], rule: SelectionRule) -> list[PassSpec]:
        """Dev: every window at each method's best stage-1 point (the closest to the rule when none meets it), and
        the same point with the final check flipped (it costs one LLM read per answer, and may not pay for it)."""
        out = []
        for m in self.methods:
            best = best_row(dev_rows, rule, m, feasible_only=False)
            if best is None:
                continue
            f, rho = best.extra["target_llm_fraction"], best.extra["verify_rho"]
            out += [self.spec("dev", m, f, best.tau or 0.0, rho, w) for w in self.params.windows]
            out.append(self.spec("dev", m, f, best.tau or 0.0, rho, 0, not self.params.final))
        return out

    def test_curve(self, chosen: Mapping[str, SweepRow | None]) -> list[PassSpec]:
        """Test: each method's fractions at the ρ and W chosen on dev."""
        out = []
        for m in self.methods:
            row = chosen.get(m)
            if row is None:
                continue
            rho, w, fin = row.extra["verify_rho"], row.extra["verify_window"], row.extra["verify_final"]
            out += [self.spec("test", m, f, tau, rho, w, fin) for f, tau in self.taus[self.routers[m]]]
        return out
