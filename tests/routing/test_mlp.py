"""The MLP router: architecture/interface, training behaviour (separable data, early stopping, determinism), storage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from citer.config import RouterParams
from citer.routing.label_store import LabelSet, make_tokens_table
from citer.routing.mlp import (
    MLPRouter,
    RouterError,
    expected_calibration_error,
    iteration_summary,
    load_router,
    roc_auc,
    router_meta,
    save_router,
    split_by_example,
    train_router,
    write_router_report,
)


def make_labelset(hidden: torch.Tensor, labels: list[int], example_ids: list[str]) -> LabelSet:
    n = len(labels)
    pos: dict[str, int] = {}
    positions = []
    for e in example_ids:
        positions.append(pos.get(e, 0))
        pos[e] = positions[-1] + 1
    table = make_tokens_table(
        {
            "example_id": example_ids,
            "position": positions,
            "case": ["slm_correct" if y else "llm_correct" for y in labels],
            "label": labels,
            "iteration": [1] * n,
            "row": list(range(n)),
            "slm_token": [0] * n,
            "llm_token": [0] * n,
            "ref_token": [0] * n,
        }
    )
    return LabelSet(
        hidden=hidden, tokens=table, meta={"iteration": 1, "slm": "models/slm", "llm": "models/llm"}
    )


def separable(n_examples: int = 60, per_ex: int = 20, h: int = 16, seed: int = 0) -> LabelSet:
    """Label = which side of a random hyperplane the hidden state lies on (with a margin), 70/30 balance."""
    g = torch.Generator().manual_seed(seed)
    n = n_examples * per_ex
    x = torch.randn(n, h, generator=g)
    w = torch.randn(h, generator=g)
    proj = x @ w
    thr = torch.quantile(proj, 0.3)
    x = x + 0.5 * torch.sign(proj - thr)[:, None] * w / w.norm()  # push the classes apart along w
    labels = (proj > thr).long().tolist()
    ids = [str(i // per_ex) for i in range(n)]
    return make_labelset(x.half(), labels, ids)


def test_router_interface_shapes_dtypes():
    r = MLPRouter(8).eval()
    assert [type(m).__name__ for m in r.net] == [
        "Linear", "BatchNorm1d", "ReLU", "Dropout", "Linear", "BatchNorm1d", "ReLU", "Dropout", "Linear",
    ]  # fmt: skip
    assert r.net[0].out_features == 16 and r.net[4].out_features == 8 and r.net[8].out_features == 1
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        s = r(torch.randn(1, 8).to(dtype))
        assert s.shape == (1,) and s.dtype == torch.float32
        assert 0.0 <= float(s) <= 1.0
    with pytest.raises(RouterError, match="shape"):
        r(torch.randn(3, 9))


def test_learns_separable_problem():
    ls = separable()
    model, m = train_router(ls, RouterParams(epochs=15, batch_size=128, patience=5))
    assert m.val_auc > 0.95, m
    assert 0.0 <= m.val_ece <= 1.0 and m.val_accuracy > 0.85
    assert abs(m.label_balance - 0.7) < 0.1
    assert m.pos_weight == pytest.approx((1 - m.label_balance) / m.label_balance)
    assert not model.training
    assert len(m.curves) == m.epochs_run and {"epoch", "train_loss", "val_loss", "val_auc"} <= set(
        m.curves[0]
    )
    assert m.n_train + m.n_val == ls.n_tokens and m.n_val_examples == 12  # 20% of 60 examples


def test_split_is_by_example():
    ids = [str(i // 7) for i in range(70)]
    tr, va = split_by_example(ids, 0.3, seed=3)
    assert len(tr) + len(va) == 70
    assert not {ids[i] for i in tr} & {ids[i] for i in va}
    assert len({ids[i] for i in va}) == 3
    with pytest.raises(RouterError, match="example_id"):
        split_by_example(["a"] * 5, 0.2, 0)


def test_early_stopping_keeps_best_epoch():
    # Random labels on few examples: the MLP overfits, so validation loss rises after an early minimum.
    g = torch.Generator().manual_seed(1)
    n = 400
    x = torch.randn(n, 8, generator=g)
    labels = torch.randint(0, 2, (n,), generator=g).tolist()
    ls = make_labelset(x, labels, [str(i // 10) for i in range(n)])
    params = RouterParams(lr=1e-2, epochs=40, batch_size=32, patience=6, dropout=0.0, val_fraction=0.25)
    model, m = train_router(ls, params)
    losses = [c["val_loss"] for c in m.curves]
    assert m.best_epoch == int(np.argmin(losses)) + 1
    assert m.best_epoch < m.epochs_run, "test needs validation loss to rise after its minimum"
    assert m.epochs_run < params.epochs  # patience stopped it
    # The returned weights are the best epoch's: recompute its validation loss from scratch.
    _, va = split_by_example(ls.tokens["example_id"].tolist(), params.val_fraction, params.seed)
    y = torch.tensor(labels, dtype=torch.float32)[va]
    with torch.no_grad():
        loss = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(m.pos_weight))(model.logits(x[va]), y)
    assert float(loss) == pytest.approx(losses[m.best_epoch - 1], rel=1e-5)
    assert float(loss) < losses[-1]
    assert m.val_loss == pytest.approx(losses[m.best_epoch - 1])


def test_training_is_deterministic():
    ls = separable(n_examples=20, per_ex=10, seed=4)
    p = RouterParams(epochs=3, batch_size=64)
    m1, r1 = train_router(ls, p)
    m2, r2 = train_router(ls, p)
    assert r1.to_dict() == r2.to_dict()
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    _, r3 = train_router(ls, RouterParams(epochs=3, batch_size=64, seed=1))
    assert r3.to_dict() != r1.to_dict()


def test_multi_tensor_adamw_trains_the_router_of_the_per_tensor_loop(monkeypatch):
    """Training uses AdamW's multi-tensor (foreach) path for speed; it must give bitwise the router that the
    per-tensor loop gives, or every reported number would move with the switch."""
    ls = separable(n_examples=20, per_ex=10, seed=4)
    p = RouterParams(epochs=3, batch_size=64, weight_decay=0.05)
    used = []
    adamw = torch.optim.AdamW

    def spy(*args, **kwargs):
        used.append(kwargs.get("foreach"))
        return adamw(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    fast, _ = train_router(ls, p)
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: adamw(*a, **(k | {"foreach": False})))
    loop, _ = train_router(ls, p)
    assert used == [True]
    for (k, a), (_, b) in zip(fast.state_dict().items(), loop.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_bad_inputs_rejected_before_training():
    x = torch.randn(10, 4)
    with pytest.raises(RouterError, match="SLM-preferred for all 10 tokens"):
        train_router(make_labelset(x, [1] * 10, [str(i // 2) for i in range(10)]), RouterParams())
    with pytest.raises(RouterError, match="LLM-preferred"):
        train_router(make_labelset(x, [0] * 10, [str(i // 2) for i in range(10)]), RouterParams())
    empty = make_labelset(torch.zeros(0, 4), [], [])
    with pytest.raises(RouterError, match="empty"):
        train_router(empty, RouterParams())
    bad = make_labelset(x, [0, 1] * 5, [str(i // 2) for i in range(10)])
    bad.tokens.loc[3, "label"] = 7
    with pytest.raises(RouterError, match="row 3, field label=7"):
        train_router(bad, RouterParams())
    nan = make_labelset(x.clone(), [0, 1] * 5, [str(i // 2) for i in range(10)])
    nan.hidden[2, 1] = float("nan")
    with pytest.raises(RouterError, match="NaN"):
        train_router(nan, RouterParams())


def test_save_load_roundtrip_and_mismatch(tmp_path):
    ls = separable(n_examples=10, per_ex=10, h=8)
    model, m = train_router(ls, RouterParams(epochs=2, batch_size=32))
    meta = router_meta(ls, m)
    out = save_router(model, tmp_path / "iter1", meta)
    info = json.loads((out / "router.json").read_text())
    assert {"hidden_size", "dropout", "slm", "llm", "iteration", "data_hash", "metrics"} <= set(info)
    assert info["hidden_size"] == 8 and info["metrics"]["val_auc"] == m.val_auc
    loaded, meta2 = load_router(out, expected_hidden_size=8, expected_slm="models/slm/")
    assert not loaded.training and meta2["data_hash"] == meta["data_hash"]
    x = torch.randn(5, 8)
    assert torch.equal(loaded(x), model(x))
    with pytest.raises(RouterError, match="hidden_size=8 but the SLM's hidden size is 16"):
        load_router(out, expected_hidden_size=16)
    with pytest.raises(RouterError, match="field slm='models/slm' but the SLM in use is 'other/slm'"):
        load_router(out, expected_slm="other/slm")
    with pytest.raises(RouterError, match="missing"):
        load_router(tmp_path / "nothing")
    assert not list(tmp_path.glob(".*tmp"))  # atomic: no temporary leftovers


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_corrupt_weights_file_is_one_line_naming_it(tmp_path, damage):
    ls = separable(n_examples=4, per_ex=5, h=8)
    model, m = train_router(ls, RouterParams(epochs=1, batch_size=32))
    out = save_router(model, tmp_path / "iter2", router_meta(ls, m))
    weights = out / "router.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * len(data))
    with pytest.raises(RouterError) as info:
        load_router(out, expected_hidden_size=8)
    text = str(info.value)
    assert str(weights) in text and "not a readable safetensors file" in text and "\n" not in text


def test_auc_and_ece_match_definitions():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = np.round(rng.random(200), 1)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg)
    )
    assert roc_auc(y, s) == pytest.approx(brute)
    assert np.isnan(roc_auc(np.ones(3), np.arange(3.0)))
    assert expected_calibration_error(np.array([1, 0, 1, 1]), np.array([1.0, 0.0, 1.0, 1.0])) == 0.0
    assert expected_calibration_error(np.array([0, 0]), np.array([0.8, 0.8])) == pytest.approx(0.8)


def test_router_report(tmp_path):
    ls = separable(n_examples=10, per_ex=10, h=8)
    _, m = train_router(ls, RouterParams(epochs=2, batch_size=32))
    path = write_router_report(tmp_path / "reports" / "router.json", [iteration_summary(ls, m)])
    rep = json.loads(path.read_text())
    it = rep["iterations"][0]
    assert {"iteration", "n_tokens", "case_counts", "val_auc", "val_loss"} <= set(it)
    assert it["n_tokens"] == 100 and set(it["case_counts"]) == {"slm_correct", "llm_correct", "both_wrong"}
    with pytest.raises(RouterError, match="entry 0, fields \\['val_auc'\\] missing"):
        write_router_report(
            tmp_path / "r.json", [{"iteration": 1, "n_tokens": 1, "case_counts": {}, "val_loss": 0}]
        )


# ------------------------------------------------------------------------------------------------ width and depth


def test_widths_build_the_layers_and_the_default_is_the_papers():
    from citer.routing.architecture import layer_widths, layers_tag

    torch.manual_seed(0)
    paper = MLPRouter(8)
    torch.manual_seed(0)
    same = MLPRouter(8, widths=layer_widths([2.0, 1.0], 8))
    assert paper.widths == same.widths == (16, 8)
    assert list(paper.state_dict()) == list(same.state_dict()) and all(
        torch.equal(a, b)
        for a, b in zip(paper.state_dict().values(), same.state_dict().values(), strict=True)
    )  # the same keys and, seeded, the same initial weights as before the width was a param
    probe = MLPRouter(8, widths=())
    assert [type(m).__name__ for m in probe.net] == ["Linear"] and probe.weight_bytes == 4 * (8 + 1)
    narrow = MLPRouter(8, widths=layer_widths([0.25], 8))  # 2 units: Linear, BatchNorm (4 per unit), head
    assert narrow.widths == (2,) and narrow.weight_bytes == 4 * (8 * 2 + 2 + 4 * 2 + 2 + 1)
    assert layer_widths([0.01], 8) == (1,)  # never a layer of no units
    assert [layers_tag(x) for x in ([2.0, 1.0], [0.25], [])] == ["w2-1", "w0.25", "linear"]
    with pytest.raises(ValueError, match="widths"):
        MLPRouter(8, widths=(0,))


def test_a_narrow_router_and_a_linear_probe_train_and_round_trip(tmp_path):
    ls = separable()
    for layers in ([0.5], []):
        model, m = train_router(ls, RouterParams(lr=1e-2, epochs=15, batch_size=128, layers=layers))
        assert m.val_auc > 0.9, (layers, m)
        d = save_router(model, tmp_path / str(layers), {"slm": "models/slm"})
        assert json.loads((d / "router.json").read_text())["widths"] == list(model.widths)
        back, _ = load_router(d)
        assert back.widths == model.widths
        x = torch.randn(5, 16)
        assert torch.equal(back(x), model(x))


def test_a_router_saved_before_widths_loads_as_the_papers(tmp_path):
    d = save_router(MLPRouter(8).eval(), tmp_path / "r", {"slm": "s"})
    meta = json.loads((d / "router.json").read_text())
    del meta["widths"]
    (d / "router.json").write_text(json.dumps(meta))
    assert load_router(d)[0].widths == (16, 8)
    meta["widths"] = [4]  # the weights are (16, 8): a wrong record is refused, naming the file and the field
    (d / "router.json").write_text(json.dumps(meta))
    with pytest.raises(RouterError, match=r"router.safetensors: weights do not fit .*widths=\[4\]"):
        load_router(d)
    meta["widths"] = ["a"]
    (d / "router.json").write_text(json.dumps(meta))
    with pytest.raises(RouterError, match=r"router.json: field widths"):
        load_router(d)


def test_the_width_params_refuse_what_cannot_be_a_router():
    assert RouterParams().layers == [2.0, 1.0] and RouterParams().layers_grid == []
    with pytest.raises(ValueError, match="multiples"):
        RouterParams(layers=[0.0])
    with pytest.raises(ValueError, match="twice"):
        RouterParams(layers_grid=[[0.5], [0.5]])
    with pytest.raises(ValueError, match="multiples"):
        RouterParams(layers_grid=[[0.5], [-1.0]])
