"""Claims across router seeds: seed-free passes decoded once and handed back unchanged, every claim's spread."""

from __future__ import annotations

import pytest
from conftest import answering_rows

from citer.config import RouterParams, SelectionRule, SweepParams
from citer.evaluation.plan import PassSpec, run_in_order
from citer.evaluation.report import claims_both
from citer.evaluation.stability import ReusePasses, flat_claims, outcome, seed_free, spread


def _params() -> SweepParams:
    return SweepParams(
        llm_fractions=[0.05, 0.2],
        batch_size=16,
        max_new_tokens=12,
        query={"train_examples": 32, "epochs": 50},
        intervals={"resamples": 200},
        verify={"rhos": [1.0], "fractions": [0.1], "windows": [4]},
        rule={"accuracy_ratio": 0.9},
    )


def test_only_passes_no_router_seed_can_change_are_seed_free():
    assert seed_free(PassSpec("dev llm", "dev", "llm", "llm"))
    assert seed_free(PassSpec("test speculative", "test", "speculative", "speculative"))
    for router in ("random", "confidence", "oracle"):
        assert seed_free(PassSpec("x", "dev", method="m", router=router))
    for router in ("citer", "citer_s", "citer@w0.25", "citer_logits"):
        assert not seed_free(PassSpec("x", "dev", method="m", router=router))


class Counting:
    """The real in-order pass map, counting what it decodes."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, bench, specs):
        self.names += [s.name for s in specs]
        return run_in_order(bench, specs)


@pytest.fixture(scope="module")
def two_seeds(answering_pair):
    """Two sweeps whose routers differ only in their training seed, through one ReusePasses; and a third, fresh."""
    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import train_router

    pair = answering_pair
    counting = Counting()
    reuse = ReusePasses(counting)
    out = []
    for seed in (0, 1, 1):
        router, _ = train_router(pair.labels, RouterParams(epochs=10, batch_size=128, seed=seed))
        passes = reuse if len(out) < 2 else Counting()
        res = run_sweep(pair.slm, pair.llm, pair.tok, answering_rows(11, 24), answering_rows(12, 24), "math",
                        {"citer": router}, _params(), train_rows=answering_rows(13, 32), passes=passes)  # fmt: skip
        out.append((res, counting.names[:] if len(out) < 2 else passes.names))
    return out, reuse


def test_seed_free_passes_are_decoded_once_and_change_nothing(two_seeds):
    (first, names1), (second, names2), (fresh, _) = two_seeds[0]
    reuse = two_seeds[1]
    again = names2[len(names1) :]  # what the second sweep decoded
    assert again and all("citer" in n for n in again)  # only the router's own passes (citer, citer_verify)
    assert reuse.reused == len(names1) - len(again) > 0
    # the second sweep, with passes handed back, is the sweep decoded from scratch
    for a, b in zip(second.test + second.dev, fresh.test + fresh.dev, strict=True):
        assert (a.method, a.tau, a.accuracy, a.bytes_moved, a.bytes_priced) == (
            b.method, b.tau, b.accuracy, b.bytes_moved, b.bytes_priced,
        )  # fmt: skip

    # and the routers did differ between the seeds
    def points(res):
        return [(r.tau, r.accuracy, r.bytes_moved) for r in res.dev if r.method == "citer"]

    assert points(first) != points(second)


def test_every_claim_spreads_across_seeds_under_both_pricings(two_seeds):
    (first, _), (second, _), _ = two_seeds[0]
    p = _params()
    outs = {
        s: outcome(claims_both(r.test, p), r.dev, r.test, p.rule, r.notes)
        for s, r in ((0, first), (1, second))
    }
    rep = spread(outs, 0, p.rule)
    assert rep["seeds"] == [0, 1] and rep["selected_on"] == "dev"
    for pricing in ("measured", "priced"):
        table = rep["claims"][pricing]
        assert "citer: oracle_ratio" in table and "citer_verify: saving vs bild" in table
        for c in table.values():
            values = [c["by_seed"][s]["value"] for s in ("0", "1")]
            assert c["main"]["value"] == values[0]
            finite = [v for v in values if v is not None]
            assert (c["min"], c["max"]) == ((min(finite), max(finite)) if finite else (None, None))
            verdicts = [c["by_seed"][s]["holds_at_95"] for s in ("0", "1")]
            assert c["holds_in_every_seed"] == all(v is True for v in verdicts)
    priced = rep["claims"]["priced"]["citer: oracle_ratio"]["main"]["statement"]
    assert priced.startswith("Priced at Qwen2-1.5B/Qwen2-72B bf16: ")
    points = rep["promoted"]["by_seed"]
    for s, r in (("0", first), ("1", second)):
        if points[s] is not None:
            row = next(t for t in r.test if t.method == points[s]["method"] and t.tau == points[s]["tau"])
            assert points[s]["accuracy"] == row.accuracy and points[s]["accuracy_ratio"] == pytest.approx(
                row.accuracy / row.llm_accuracy
            )
    ratios = [p["accuracy_ratio"] for p in points.values() if p]
    assert rep["promoted"]["min_accuracy_ratio"] == (min(ratios) if len(ratios) == 2 else None)


def test_flat_claims_names_every_claim():
    found = {
        "oracle_ratio": {"value": 1.5, "ci": [1.2, 1.8], "holds_at_95": True, "statement": "a"},
        "bytes_at_target": None,
        "savings": {"bild": {"value": 0.1, "ci": [-0.1, 0.2], "holds_at_95": False, "statement": "b"}},
        "verified": {
            "citer_verify": {
                "savings": {"citer": {"value": -0.2, "ci": None, "holds_at_95": None, "statement": "c"}}
            }
        },  # fmt: skip
    }
    assert flat_claims(found) == {
        "citer: oracle_ratio": {"value": 1.5, "ci": [1.2, 1.8], "holds_at_95": True, "statement": "a"},
        "citer: saving vs bild": {"value": 0.1, "ci": [-0.1, 0.2], "holds_at_95": False, "statement": "b"},
        "citer_verify: saving vs citer": {"value": -0.2, "ci": None, "holds_at_95": None, "statement": "c"},
    }
    rule = SelectionRule()
    one = {"claims": {"measured": flat_claims(found), "priced": {}}, "promoted": None, "router_width": None}
    two = {"claims": {"measured": {}, "priced": {}}, "promoted": None, "router_width": None}
    rep = spread({0: one, 1: two}, 0, rule)
    c = rep["claims"]["measured"]["citer: oracle_ratio"]
    assert c["by_seed"]["1"]["value"] is None and not c["holds_in_every_seed"]  # missing in a seed: not held
    assert rep["promoted"]["min_accuracy_ratio"] is None


def test_a_router_pass_is_decoded_again_when_its_router_changes(tiny_pair):
    import torch

    from citer.evaluation.plan import PassBench
    from citer.evaluation.sweep import _split
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = tiny_pair
    bench = PassBench(slm, llm, tok, "math", SweepParams(batch_size=4, max_new_tokens=4))
    bench.splits["dev"] = _split(tok, answering_rows(1, 4), "math", 0, "dev")
    specs = [PassSpec("dev citer", "dev", method="citer", router="citer", tau=0.5),
             PassSpec("dev random", "dev", method="random", router="random", tau=0.5, fraction=0.5)]  # fmt: skip
    counting = Counting()
    reuse = ReusePasses(counting)
    for seed in (0, 1):
        torch.manual_seed(seed)
        bench.routers["citer"] = MLPRouter(slm.config.hidden_size).eval()  # another router, the same τ
        outs = reuse(bench, specs)
    assert counting.names == ["dev citer", "dev random", "dev citer"] and reuse.reused == 1
    assert outs[1] is reuse.done[ReusePasses.key(specs[1])]
