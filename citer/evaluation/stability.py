"""Claims across training noise: the routers retrained with other seeds, every claim and the promoted point again.

A claim's bootstrap interval covers which test questions were drawn, not which router training happened to produce:
a small numeric change in training moves the routers, and with them the points the rule picks. Here the routers the
sweep compares are retrained with seeds ``router.seed + 1 .. router.seed + K - 1`` on the same label sets (labels
and models fixed), and each seed's routers go through the whole sweep protocol again: τ, width, router variant, ρ
and W chosen on dev, reported on test. The main run (``router.seed``) is the sweep's own reports. Per claim, under
both pricings, :func:`spread` puts the value in every seed beside the main run's interval and says whether it holds
in every seed.

Passes whose outcome no router's seed can change (the references, speculative decoding, random routing, the
confidence router and BiLD on it, the oracle) are decoded once and handed to every later seed (:class:`ReusePasses`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from citer.config import SelectionRule
from citer.evaluation.plan import RANDOM, PassBench, PassMap, PassOutcome, PassSpec
from citer.evaluation.promotion import VERIFY_KEYS, plan_promotion
from citer.evaluation.sweep_rows import SweepRow

SEED_FREE = (RANDOM, "confidence", "oracle")  # router keys that no router training touches


def seed_free(spec: PassSpec) -> bool:
    """Whether a pass decodes the same whatever seed the routers were trained with."""
    return spec.kind != "routed" or spec.router in SEED_FREE


class ReusePasses:
    """A pass map that decodes each seed-free pass once and hands its outcome back to every later sweep (the
    splits and params must be the same: one instance per stability run)."""

    def __init__(self, inner: PassMap) -> None:
        self.inner = inner
        self.done: dict[tuple[Any, ...], PassOutcome] = {}
        self.reused = 0

    @staticmethod
    def key(spec: PassSpec) -> tuple[Any, ...]:
        return (
            spec.split,
            spec.kind,
            spec.router,
            spec.tau,
            spec.fraction,
            tuple(sorted(spec.engine.items())),
        )

    def __call__(self, bench: PassBench, specs: Sequence[PassSpec]) -> list[PassOutcome]:
        todo = [s for s in specs if not (seed_free(s) and self.key(s) in self.done)]
        fresh = dict(zip((id(s) for s in todo), self.inner(bench, todo), strict=True))
        out = []
        for s in specs:
            if id(s) in fresh:
                if seed_free(s):
                    self.done[self.key(s)] = fresh[id(s)]
                out.append(fresh[id(s)])
            else:
                self.reused += 1
                out.append(self.done[self.key(s)])
        return out


def flat_claims(found: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every claim of a ``sweep_claims.json``-shaped dict (CITER's, then each verified decoder's) by a readable key:
    ``citer: oracle_ratio``, ``citer_verify: saving vs bild``, ``citer: not worse than confidence``; each with its
    value, interval, whether it holds at 95% and its statement."""
    out: dict[str, dict[str, Any]] = {}
    for method, c in [("citer", found), *sorted((found.get("verified") or {}).items())]:
        named = [(k, c.get(k)) for k in ("bytes_at_target", "oracle_ratio", "oracle_ratio_at_target")]
        named += [(f"saving vs {b}", v) for b, v in sorted((c.get("savings") or {}).items())]
        named += [(f"not worse than {b}", v) for b, v in sorted((c.get("dominance_at_95") or {}).items())]
        for name, v in named:
            if v:
                out[f"{method}: {name}"] = {k: v.get(k) for k in ("value", "ci", "holds_at_95", "statement")}
    return out


def promoted_point(
    dev: Sequence[SweepRow], test: Sequence[SweepRow], rule: SelectionRule
) -> dict[str, Any] | None:
    """The point the promotion rule picks on dev among the candidates, on test (None when none meets the rule)."""
    best = plan_promotion(dev, test, rule).best
    if best is None:
        return None
    return {
        "method": best.method,
        "router": best.extra.get("router", best.method),
        "tau": best.tau,
        **{k: best.extra[k] for k in VERIFY_KEYS if k in best.extra},
        "accuracy": best.accuracy,
        "llm_accuracy": best.llm_accuracy,
        "accuracy_ratio": best.accuracy / best.llm_accuracy if best.llm_accuracy else None,
        "bytes_moved_rel_llm": best.bytes_moved_rel_llm,
        "bytes_priced_rel_llm": best.bytes_priced_rel_llm,
    }


def outcome(found: Mapping[str, Any], dev: Sequence[SweepRow], test: Sequence[SweepRow], rule: SelectionRule,
            notes: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One seed's result: its claims under both pricings, its promoted point, and the router width it chose."""
    layers = (notes or found.get("protocol") or {}).get("router_layers") or {}
    return {
        "claims": {"measured": flat_claims(found), "priced": flat_claims(found.get("priced") or {})},
        "promoted": promoted_point(dev, test, rule),
        "router_width": layers.get("chosen"),
    }


def spread(outcomes: Mapping[int, Mapping[str, Any]], main_seed: int, rule: SelectionRule) -> dict[str, Any]:
    """Per claim and pricing: the main run's value, interval and statement, the value and verdict in every seed,
    their range, and whether the claim holds (at 95%, on its own interval) in every seed; the promoted point in
    every seed and its least accuracy as a share of LLM-only accuracy."""
    seeds = sorted(outcomes)
    main = outcomes[main_seed]
    table: dict[str, dict[str, Any]] = {}
    for pricing in ("measured", "priced"):
        table[pricing] = {}
        for key, c in main["claims"][pricing].items():
            got = {s: outcomes[s]["claims"][pricing].get(key) or {} for s in seeds}
            values = [g.get("value") for g in got.values()]
            finite = [v for v in values if v is not None]
            table[pricing][key] = {
                "main": c,
                "by_seed": {
                    str(s): {"value": g.get("value"), "ci": g.get("ci"), "holds_at_95": g.get("holds_at_95")}
                    for s, g in got.items()
                },  # fmt: skip
                "min": min(finite) if finite else None,
                "max": max(finite) if finite else None,
                "holds_in_every_seed": all(g.get("holds_at_95") is True for g in got.values()),
                "holds_in_no_seed": all(g.get("holds_at_95") is False for g in got.values()),
            }
    points = {str(s): outcomes[s]["promoted"] for s in seeds}
    ratios = [p["accuracy_ratio"] for p in points.values() if p and p.get("accuracy_ratio") is not None]
    return {
        "seeds": seeds,
        "main_seed": main_seed,
        "selected_on": "dev",
        "reported_on": "test",
        "claims": table,
        "promoted": {
            "by_seed": points,
            "min_accuracy_ratio": min(ratios) if len(ratios) == len(seeds) else None,
            "rule_accuracy_ratio": rule.accuracy_ratio if rule.kind == "min_bytes_at_accuracy" else None,
        },
        "router_width": {str(s): outcomes[s]["router_width"] for s in seeds},
    }
