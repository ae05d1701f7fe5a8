"""The priced-at-scale column: shapes priced as ModelCost prices real models, the reference pair by hand, every sweep
row re-priced exactly (at the pair that ran it gives back the measured bytes), and the measured column untouched."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import answering_rows, make_qwen2

from citer.config import ModelShapeParams, PriceAtParams, RouterParams, SweepParams
from citer.decoding.baselines import router_read_bytes
from citer.decoding.cost import ModelCost
from citer.evaluation.pricing import (
    CallCounts,
    Pricing,
    PricingError,
    RouterShape,
    check_measured,
    labelled,
    priced_view,
    router_shape,
    shape_cost,
)
from citer.routing.features import FEATURES, FeatureRouter, input_dim
from citer.routing.mlp import MLPRouter


def _shape(model) -> ModelShapeParams:
    c = model.config
    return ModelShapeParams(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_word_embeddings,
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shapes_price_as_model_cost_prices_a_real_model(tied, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    got = shape_cost(_shape(model), torch.finfo(dtype).bits // 8)
    assert got == ModelCost.from_model(model)


def test_the_reference_pair_by_hand():
    ref = Pricing.reference(PriceAtParams())
    # Qwen2-1.5B: per layer q 1536*1536+1536, k and v 1536*256+256 each, o 1536*1536, MLP 3*1536*8960, two norms;
    # 28 layers, the final norm and the tied vocabulary once (151936*1536): 1,543,714,304 parameters in bf16.
    layer = 1536 * 1536 + 1536 + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert layer == 46_797_824
    assert ref.slm.weight_bytes == 2 * (28 * layer + 1536 + 151936 * 1536) == 2 * 1_543_714_304
    # Qwen2-72B: the untied input embedding (152064*8192) is a lookup, the head is read: 72.7B - 1.25B parameters.
    layer = 8192 * 8192 + 8192 + 2 * (8192 * 1024 + 1024) + 8192 * 8192 + 3 * 8192 * 29568 + 2 * 8192
    assert (
        ref.llm.weight_bytes
        == 2 * (80 * layer + 8192 + 152064 * 8192)
        == 2 * (72_706_203_648 - 152064 * 8192)
    )
    assert ref.slm.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2 == 28_672
    assert ref.llm.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    # The paper's router on 1536: 1536 -> 3072 -> 1536 -> 1 with BatchNorm (weight, bias, mean, var), in bf16.
    router = RouterShape("mlp", (2.0, 1.0))
    n = (1536 * 3072 + 3072 + 4 * 3072) + (3072 * 1536 + 1536 + 4 * 1536) + 1536 + 1
    assert router.read_bytes(1536, 2) == 2 * n == 18_923_522
    # 40 SLM steps that read the router, 3 LLM calls: every count at its own price.
    c = CallCounts(slm_calls=40, slm_kv=3000, llm_calls=3, llm_kv=200, router_calls=40)
    want = 40 * 3_087_428_608 + 40 * 18_923_522 + 3000 * 28_672 + 3 * 142_920_990_720 + 200 * 327_680
    assert ref.price(c, router.read_bytes(1536, 2)) == want


@pytest.mark.parametrize("widths", [None, (16,), (8, 4), ()])
@pytest.mark.parametrize("features", [("hidden",), FEATURES])
def test_a_router_shape_reads_what_the_router_reads(widths, features):
    h = 32
    slm = make_qwen2(97, hidden_size=h, num_hidden_layers=1, seed=1)
    mlp = MLPRouter(h, input_dim=input_dim(h, features), widths=widths)
    router = mlp if features == ("hidden",) else FeatureRouter(mlp, *reversed(slm_parts(slm)), features)
    shape = router_shape(router)
    assert shape.read_bytes(h, 4) == router_read_bytes(router, slm) > 0
    # At another hidden size the same layers, as multiples of it: what that router would read.
    wide = [round(w / h * 64) for w in mlp.widths]
    assert shape.read_bytes(64, 4) == MLPRouter(
        64, input_dim=input_dim(64, features), widths=wide
    ).weight_bytes + (64 * 4 if "token_embedding" in features else 0)


def slm_parts(slm):
    return slm.get_input_embeddings(), slm.get_output_embeddings()


def test_counts_that_do_not_give_back_the_bytes_are_refused():
    pair = Pricing("p", ModelCost(100, 3), ModelCost(1000, 7), 8, 4)
    c = CallCounts(2, 10, 1, 5, 2)
    ok = 2 * 100 + 2 * 9 + 10 * 3 + 1000 + 5 * 7
    check_measured([c], [ok], pair, 9, "pass x")
    with pytest.raises(PricingError, match="pass x: question 0"):
        check_measured([c], [ok + 3], pair, 9, "pass x")


def test_claims_are_labelled_with_their_pair():
    got = labelled({"a": {"statement": "CITER wins", "value": 1}, "b": [{"statement": "x"}]}, "P")
    assert got == {
        "a": {"statement": "Priced at P: CITER wins", "value": 1},
        "b": [{"statement": "Priced at P: x"}],
    }


# ------------------------------------------------------------------------------------------------ the real sweep


def _own_shapes(pair) -> PriceAtParams:
    """The pair that runs, as a reference pair: priced there, every row must give back its measured bytes."""
    return PriceAtParams(name="itself", dtype_bytes=4, slm=_shape(pair.slm), llm=_shape(pair.llm))


def _params(price_at) -> SweepParams:
    return SweepParams(
        llm_fractions=[0.05, 0.2],
        batch_size=16,
        max_new_tokens=12,
        query={"train_examples": 32, "epochs": 50},
        intervals={"resamples": 200},
        verify={"rhos": [1.0, 4.0], "fractions": [0.05, 0.2], "windows": [4]},
        price_at=price_at,
    )


@pytest.fixture(scope="module")
def grid(answering_pair):
    """The CITER router at three widths of the grid (the paper's, a narrow MLP, a linear probe) on the same labels."""
    from citer.routing.architecture import LAYERS_METHOD, layers_tag
    from citer.routing.mlp import train_router

    out = {}
    for layers in ([2.0, 1.0], [0.25], []):
        rp = RouterParams(epochs=30, batch_size=128, patience=30, layers=layers)
        out[LAYERS_METHOD + layers_tag(layers)] = train_router(answering_pair.labels, rp)[0]
    return out


def _sweep(pair, params, grid=None, **kw):
    from citer.evaluation.sweep import run_sweep

    return run_sweep(pair.slm, pair.llm, pair.tok, answering_rows(11, 32), answering_rows(12, 32), "math",
                     {"citer": pair.router}, params, train_rows=answering_rows(13, 32), layer_routers=grid,
                     **kw)  # fmt: skip


@pytest.fixture(scope="module")
def at_itself(answering_pair, grid):
    return _sweep(answering_pair, _params(_own_shapes(answering_pair)), grid)


def test_priced_at_the_pair_that_ran_every_row_gives_back_its_measured_bytes(at_itself):
    rows = at_itself.dev + at_itself.test
    methods = {r.method for r in rows}
    # every kind of pass: references, routers (a linear probe too), random, confidence, query, speculative, the
    # oracle and the verified decoders with their check calls and rollbacks
    assert {"llm", "slm", "citer", "citer@linear", "random", "confidence", "query", "speculative", "oracle",
            "citer_verify", "bild"} <= methods  # fmt: skip
    assert any(r.extra.get("rolled_back_tokens") for r in rows)
    for r in rows:
        assert r.priced_at == "itself"
        assert r.bytes_priced == pytest.approx(r.bytes_moved, rel=1e-12), r.method
        assert r.bytes_priced_rel_llm == pytest.approx(r.bytes_moved_rel_llm, rel=1e-12), r.method
        assert r.question_bytes_priced == pytest.approx(r.question_bytes, rel=1e-12)


def test_the_width_is_chosen_on_dev_and_only_it_runs_on_test(at_itself, grid):
    res = at_itself
    chosen = res.notes["router_layers"]["chosen"]
    assert chosen in grid and res.notes["router_layers"]["selected_on"] == "dev"
    # every width decoded on dev at every fraction, none of them on test but as citer
    for m in grid:
        assert len([r for r in res.dev if r.method == m]) == len(res.thresholds[m]) >= 1
        assert not [r for r in res.test if r.method == m]
    dev_citer = sorted((r.tau, r.accuracy, r.bytes_moved) for r in res.dev if r.method == "citer")
    assert dev_citer == sorted((r.tau, r.accuracy, r.bytes_moved) for r in res.dev if r.method == chosen)
    test_citer = [r for r in res.test if r.method == "citer"]
    assert test_citer and all(r.extra["router"] == chosen for r in test_citer)
    assert res.thresholds["citer"] == res.thresholds[chosen]
    # the reads of every width, measured and priced: the linear probe reads least
    reads = res.notes["router_layers"]["grid"]
    assert min(reads, key=lambda m: reads[m]["measured"]["router_bytes"]) == "citer@linear"
    assert reads["citer@w2-1"]["measured"]["router_bytes"] == router_read_bytes(grid["citer@w2-1"])
    # the rule's own pick among the widths' best dev points
    from citer.evaluation.widths import choose_width

    order = sorted(grid, key=lambda m: (router_read_bytes(grid[m]), m))
    assert choose_width(res.dev, _params(None).rule, order) == chosen


def test_the_measured_column_does_not_move_with_the_priced_one(answering_pair, grid, at_itself, tmp_path):
    from citer.evaluation.report import write_sweep_reports

    ref = _sweep(answering_pair, _params(PriceAtParams()), grid)
    off = _sweep(answering_pair, _params(None), grid)
    for a, b, c in zip(at_itself.test, ref.test, off.test, strict=True):
        assert (a.method, a.tau) == (b.method, b.tau) == (c.method, c.tau)
        assert (
            a.bytes_moved == b.bytes_moved == c.bytes_moved
            and a.question_bytes == b.question_bytes == c.question_bytes
        )
        assert a.accuracy == b.accuracy == c.accuracy
    assert all(r.bytes_priced is None and r.priced_at == "" for r in off.test)
    # At Qwen2-1.5B/72B the SLM is ~2% of the LLM: every routed row is cheaper there than measured.
    llm_share = next(r for r in ref.test if r.method == "slm").bytes_priced_rel_llm
    assert 0.015 < llm_share < 0.03
    # The reports: the measured columns identical with and without the priced column beside them.
    write_sweep_reports(tmp_path / "on", ref, _params(PriceAtParams()))
    write_sweep_reports(tmp_path / "off", off, _params(None))
    on = json.loads((tmp_path / "on" / "sweep.json").read_text())
    no = json.loads((tmp_path / "off" / "sweep.json").read_text())
    measured = ("method", "tau", "accuracy", "bytes_moved", "bytes_moved_rel_llm", "accuracy_ci", "bytes_ci")
    assert [{k: r[k] for k in measured} for r in on] == [{k: r[k] for k in measured} for r in no]
    assert all(r["priced_at"] == "Qwen2-1.5B/Qwen2-72B bf16" and r["bytes_priced_ci"] for r in on)
    claims_on = json.loads((tmp_path / "on" / "sweep_claims.json").read_text())
    claims_off = json.loads((tmp_path / "off" / "sweep_claims.json").read_text())
    # every measured claim, and every dev choice, as without a priced column
    assert {k: v for k, v in claims_on.items() if k not in ("priced", "protocol")} == {
        k: v for k, v in claims_off.items() if k != "protocol"
    }
    assert claims_on["protocol"]["methods"] == claims_off["protocol"]["methods"]
    priced = claims_on["priced"]
    assert priced["priced_at"] == "Qwen2-1.5B/Qwen2-72B bf16"
    assert priced["oracle_ratio"]["statement"].startswith("Priced at Qwen2-1.5B/Qwen2-72B bf16: ")
    view = priced_view(ref.test)
    assert priced["oracle_ratio"]["oracle_bytes_rel"] == min(
        r.bytes_moved_rel_llm for r in view if r.method == "oracle"
    )
