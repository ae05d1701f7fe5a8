"""The CITER router's width, chosen on dev like τ: every ``router.layers_grid`` width is thresholded and decoded on
dev, the rule picks the width whose best point wins (its router's reads are in its bytes), and that router is
``citer`` from then on (its dev rows become ``citer``'s, and only it runs on test).

Pure: rows in, a choice and rows out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from citer.config import SelectionRule
from citer.decoding.baselines import Router, router_read_bytes
from citer.evaluation.plan import PassBench
from citer.evaluation.pricing import Pricing, router_shape, router_share
from citer.evaluation.promotion import best_row, choose_candidate, objective
from citer.evaluation.sweep_rows import SweepError, SweepRow, llm_reference


def choose_width(dev_rows: Sequence[SweepRow], rule: SelectionRule, methods: Sequence[str]) -> str:
    """The grid method whose best dev point best meets ``rule`` (``methods`` cheapest router first: a tie goes to
    the smaller router). When none meets it, the one closest to meeting it."""
    if not methods:
        raise SweepError("router width grid: no widths to choose from")
    row = choose_candidate(dev_rows, rule, methods)
    if row is not None:
        return row.method
    llm_acc = llm_reference(dev_rows).accuracy if rule.kind == "min_bytes_at_accuracy" else None
    best = [(m, best_row(dev_rows, rule, m, feasible_only=False)) for m in methods]
    found = [(i, m, r) for i, (m, r) in enumerate(best) if r is not None]
    if not found:
        raise SweepError(f"router width grid: no dev rows for any of {list(methods)}")
    return max(found, key=lambda x: (objective(x[2], rule, llm_acc), -x[0]))[1]


def pick_width(bench: PassBench, dev_rows: Sequence[SweepRow], grid: Mapping[str, Router]) -> dict[str, Any]:
    """The width the rule picks on dev among ``grid``'s routers (ties: the cheaper router), with every width's
    reads: ``{"chosen": method, "selected_on": "dev", "grid": {method: reads}}``."""
    reads = {m: router_read_bytes(r, bench.slm) for m, r in grid.items()}
    order = sorted(grid, key=lambda m: (reads[m], m))
    return {
        "chosen": choose_width(dev_rows, bench.params.rule, order),
        "selected_on": "dev",
        "grid": read_summary({m: grid[m] for m in order}, reads, *bench.pricings()),
    }


def as_method(rows: Sequence[SweepRow], source: str, method: str, **extra: Any) -> list[SweepRow]:
    """Copies of ``source``'s rows named ``method``, with ``extra`` added (their own ``extra`` dict)."""
    out = []
    for r in rows:
        if r.method == source:
            c = copy.copy(r)
            c.method, c.extra = method, dict(r.extra) | extra
            out.append(c)
    return out


def read_summary(
    routers: Mapping[str, Any], read_bytes: Mapping[str, int], measured: Pricing, reference: Pricing | None
) -> dict[str, dict[str, Any]]:
    """Per router: its shape, and its read per step against the SLM's weight read per call, measured on the pair
    that ran and priced at the reference pair."""
    out = {}
    for name, router in routers.items():
        shape = router_shape(router)
        out[name] = {
            **shape.describe(),
            "measured": router_share(shape, measured, read_bytes[name]),
            "priced": None if reference is None else router_share(shape, reference) | {"at": reference.name},
        }
    return out
