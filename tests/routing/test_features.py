"""Router inputs beyond the hidden state: feature values on a tiny real Qwen2 SLM, training on each feature set, the
inference wrapper (shared SLM tensors, bytes read), and checkpoints with and without features."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_qwen2
from pydantic import ValidationError

from citer.config import RouterParams
from citer.routing.features import (
    ABLATIONS,
    FEATURES,
    FeatureRouter,
    RouterError,
    feature_matrix,
    input_dim,
    router_inputs,
)
from citer.routing.label_store import LabelSet, make_tokens_table
from citer.routing.mlp import MLPRouter, load_router, router_meta, save_router, train_router

V, PAD, H = 40, 8, 16  # tokenizer ids, extra padded head/embedding rows, hidden size


@pytest.fixture(scope="module")
def slm():
    """A tiny Qwen2 whose head and embedding are padded to V + PAD rows (as Qwen2-1.5B pads its 151,646 ids)."""
    torch.manual_seed(0)
    return make_qwen2(V + PAD, hidden_size=H, num_hidden_layers=1, seed=3)


def parts(model):
    return model.get_output_embeddings(), model.get_input_embeddings()


def test_input_dim_and_canonical_order(slm):
    head, emb = parts(slm)
    h = torch.randn(5, H)
    assert input_dim(H, ["hidden"]) == H
    assert input_dim(H, ["hidden", "token_embedding"]) == 2 * H
    assert input_dim(H, ["hidden", "logit_stats"], k=3) == H + 5
    assert input_dim(H, FEATURES, k=4) == 2 * H + 6
    for feats in (["hidden"], *ABLATIONS.values()):
        for k in (1, 4):
            x = router_inputs(h, feats, head, emb, V, k)
            assert x.shape == (5, input_dim(H, feats, k)) and x.dtype == torch.float32
    a = router_inputs(h, ["logit_stats", "hidden", "token_embedding"], head, emb, V)
    assert torch.equal(a, router_inputs(h, FEATURES, head, emb, V))  # order given does not matter
    torch.testing.assert_close(a[:, :H], h)  # the hidden state comes first, unchanged
    with pytest.raises(RouterError, match="must contain 'hidden'"):
        input_dim(H, ["token_embedding"])
    with pytest.raises(RouterError, match="unknown names \\['logits'\\]"):
        router_inputs(h, ["hidden", "logits"], head, emb, V)
    with pytest.raises(RouterError, match="need the SLM"):
        router_inputs(h, FEATURES, None, None, V)


def test_token_embedding_is_the_embedding_of_the_greedy_token_within_vocab(slm):
    head, emb = parts(slm)
    h = torch.randn(6, H)
    with torch.no_grad():  # a padded head row that would win every argmax over the full width
        saved = head.weight[V].clone()
        head.weight[V] = 100.0 * h.mean(0) / h.mean(0).norm()
    try:
        full = head(h)
        assert (full.argmax(-1) >= V).any(), "test needs a padded row to win somewhere"
        greedy = full[:, :V].argmax(-1)
        x = router_inputs(h, ["hidden", "token_embedding"], head, emb, V)
        torch.testing.assert_close(x[:, H:], emb.weight[greedy].float())
    finally:
        with torch.no_grad():
            head.weight[V] = saved


def test_logit_stats_values(slm):
    head, emb = parts(slm)
    h = torch.randn(4, H)
    k = 3
    x = router_inputs(h, ["hidden", "logit_stats"], head, emb, V, k)
    logp = torch.log_softmax(head(h).float()[:, :V], dim=-1)
    top = logp.sort(dim=-1, descending=True).values
    torch.testing.assert_close(x[:, H : H + k], top[:, :k])
    assert (x[:, H : H + k].diff(dim=-1) <= 0).all()  # sorted, largest first
    torch.testing.assert_close(x[:, H + k], -(logp.exp() * logp).sum(-1))
    torch.testing.assert_close(x[:, H + k + 1], top[:, 0].exp() - top[:, 1].exp())
    # A uniform distribution over the tokenizer's V ids (a zero head): entropy log V, margin 0, top-k all -log V.
    zero = torch.nn.Linear(H, V + PAD, bias=False)
    torch.nn.init.zeros_(zero.weight)
    u = router_inputs(h, ["hidden", "logit_stats"], zero, emb, V, k)
    torch.testing.assert_close(u[:, H + k], torch.full((4,), math.log(V)))
    torch.testing.assert_close(u[:, H : H + k], torch.full((4, k), -math.log(V)))
    assert (u[:, H + k + 1] == 0).all()


def labelset(slm, n_examples: int = 40, per_ex: int = 10, seed: int = 0) -> LabelSet:
    """Random hidden states (float16, stored out of table order) labelled SLM-preferred where the SLM is confident
    (entropy below the median): a label logit_stats reads directly."""
    g = torch.Generator().manual_seed(seed)
    n = n_examples * per_ex
    hidden = (3.0 * torch.randn(n, H, generator=g)).half()
    head, emb = parts(slm)
    ent = router_inputs(hidden.float(), ["hidden", "logit_stats"], head, emb, V, 1)[:, H + 1]
    label = (ent < ent.median()).long()
    rows = torch.randperm(n, generator=g)  # table row i reads hidden[rows[i]]
    lab = label[rows].tolist()
    table = make_tokens_table(
        {
            "example_id": [str(i // per_ex) for i in range(n)],
            "position": [i % per_ex for i in range(n)],
            "case": ["slm_correct" if y else "llm_correct" for y in lab],
            "label": lab,
            "iteration": [1] * n,
            "row": rows.tolist(),
            "slm_token": [0] * n,
            "llm_token": [0] * n,
            "ref_token": [0] * n,
        }
    )
    return LabelSet(hidden, table, {"iteration": 1, "slm": "models/slm", "llm": "models/llm"})


def test_feature_matrix_follows_table_rows_in_chunks(slm):
    head, emb = parts(slm)
    ls = labelset(slm, n_examples=3)
    rows = torch.as_tensor(ls.tokens["row"].to_numpy().copy())
    x = feature_matrix(ls.hidden, rows, FEATURES, head, emb, V)
    torch.testing.assert_close(x, router_inputs(ls.hidden[rows].float(), FEATURES, head, emb, V))


@pytest.mark.parametrize("name", [None, *ABLATIONS])
def test_train_each_feature_set(slm, name):
    feats = ["hidden"] if name is None else list(ABLATIONS[name])
    ls = labelset(slm, n_examples=100, per_ex=20)
    p = RouterParams(epochs=15, batch_size=128, lr=1e-2, patience=15, features=feats)
    router, m = train_router(ls, p, slm=slm, vocab_size=V)
    if name is None:
        assert type(router) is MLPRouter and router.input_dim == H
    else:
        assert isinstance(router, FeatureRouter) and router.input_dim == input_dim(H, feats)
        assert router.features == tuple(feats) and router.vocab_size == V
    assert not router.training and m.n_train + m.n_val == ls.n_tokens
    s = router(torch.randn(7, H))
    assert s.shape == (7,) and ((s >= 0) & (s <= 1)).all()
    # The label is a threshold on one logit_stats input: routers reading it separate the classes (hidden alone: 0.92).
    assert m.val_auc > (0.95 if "logit_stats" in feats else 0.85), m
    again, m2 = train_router(ls, p, slm=slm, vocab_size=V)
    assert m2.to_dict() == m.to_dict()


def test_train_needs_slm_for_features(slm):
    ls = labelset(slm, n_examples=4)
    with pytest.raises(RouterError, match="pass slm="):
        train_router(ls, RouterParams(epochs=1, features=["hidden", "logit_stats"]))
    other = make_qwen2(V, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(RouterError, match="hidden has size 16, the SLM's is 32"):
        train_router(ls, RouterParams(epochs=1, features=["hidden", "logit_stats"]), slm=other)


def test_wrapper_shares_slm_tensors_and_counts_bytes(slm):
    head, emb = parts(slm)
    mlp = MLPRouter(H, input_dim=input_dim(H, FEATURES)).eval()
    r = FeatureRouter(mlp, head, emb, FEATURES, vocab_size=V).eval()
    assert r.head.weight.data_ptr() == head.weight.data_ptr()
    assert r.embedding.weight.data_ptr() == emb.weight.data_ptr()
    assert {n for n, _ in r.named_parameters()} == {f"mlp.{n}" for n, _ in mlp.named_parameters()}
    assert all(k.startswith("mlp.") for k in r.state_dict())
    # MLP bytes: its parameters plus BatchNorm's running mean and variance, float32.
    d = input_dim(H, FEATURES)
    n_params = (d * 2 * H + 2 * H) + 2 * (2 * H) + (2 * H * H + H) + 2 * H + (H + 1)
    n_stats = 2 * (2 * H) + 2 * H
    assert mlp.weight_bytes == 4 * (n_params + n_stats)
    assert MLPRouter(H).weight_bytes == 4 * (n_params - (d - H) * 2 * H + n_stats)
    assert r.weight_bytes == mlp.weight_bytes + H * emb.weight.element_size()  # + one embedding row
    only_logits = FeatureRouter(
        MLPRouter(H, input_dim=input_dim(H, ["hidden", "logit_stats"])), head, emb, ["hidden", "logit_stats"]
    )
    assert only_logits.weight_bytes == only_logits.mlp.weight_bytes  # the logits are the SLM step's own
    r.half()  # casts the MLP only: the SLM's embedding stays float32
    assert emb.weight.dtype == torch.float32 and head.weight.dtype == torch.float32
    assert mlp.weight_bytes == 2 * (n_params + n_stats) and r.weight_bytes == mlp.weight_bytes + 4 * H
    with pytest.raises(RouterError, match="input_dim"):
        FeatureRouter(MLPRouter(H), head, emb, FEATURES)
    with pytest.raises(RouterError, match="expected \\(B, 16\\)"):
        FeatureRouter(mlp.float(), head, emb, FEATURES)(torch.randn(2, H + 1))


def test_save_load_roundtrip_with_and_without_slm(slm, tmp_path):
    ls = labelset(slm, n_examples=10)
    p = RouterParams(epochs=2, batch_size=32, features=list(FEATURES), logit_k=3)
    router, m = train_router(ls, p, slm=slm, vocab_size=V)
    out = save_router(router, tmp_path / "ablation_emb_logits", router_meta(ls, m))
    info = json.loads((out / "router.json").read_text())
    assert info["features"] == list(FEATURES) and info["logit_k"] == 3 and info["vocab_size"] == V
    assert info["input_dim"] == 2 * H + 5 and info["hidden_size"] == H
    loaded, meta = load_router(out, expected_hidden_size=H, expected_slm="models/slm", slm=slm, vocab_size=V)
    assert isinstance(loaded, FeatureRouter) and not loaded.training and meta["features"] == list(FEATURES)
    assert loaded.head is slm.get_output_embeddings() and loaded.logit_k == 3
    x = torch.randn(9, H)
    assert torch.equal(loaded(x), router(x))
    assert torch.equal(load_router(out, slm=slm)[0](x), router(x))  # vocab_size defaults to the recorded one
    with pytest.raises(RouterError) as exc:
        load_router(out, expected_hidden_size=H)
    msg = str(exc.value)
    assert "\n" not in msg and str(out) in msg and "pass slm=" in msg
    with pytest.raises(RouterError, match="vocab_size=40 but vocab_size=45 was given"):
        load_router(out, slm=slm, vocab_size=45)
    other = make_qwen2(V, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(RouterError, match="hidden_size=16 but the SLM's is 32"):
        load_router(out, slm=other)

    plain, m = train_router(ls, RouterParams(epochs=2, batch_size=32), slm=slm, vocab_size=V)
    out = save_router(plain, tmp_path / "iter1", router_meta(ls, m))
    for kwargs in (
        {},
        {"slm": slm, "vocab_size": V},
    ):  # hidden-only routers load the same with or without slm
        got, _ = load_router(out, expected_hidden_size=H, **kwargs)
        assert type(got) is MLPRouter and torch.equal(got(x), plain(x))


def test_old_checkpoint_without_features_loads(slm, tmp_path):
    ls = labelset(slm, n_examples=10)
    router, m = train_router(ls, RouterParams(epochs=2, batch_size=32))
    out = save_router(router, tmp_path / "iter1", router_meta(ls, m))
    info = json.loads((out / "router.json").read_text())
    assert info["features"] == ["hidden"] and info["input_dim"] == H
    for key in ("features", "logit_k", "input_dim"):  # router.json as written before features existed
        del info[key]
    (out / "router.json").write_text(json.dumps(info))
    loaded, meta = load_router(out, expected_hidden_size=H)
    assert type(loaded) is MLPRouter and "features" not in meta
    x = torch.randn(4, H)
    assert torch.equal(loaded(x), router(x))
    info["features"] = ["hidden", "logit_stats"]  # a record that does not fit its weights is refused
    (out / "router.json").write_text(json.dumps(info))
    with pytest.raises(RouterError, match="weights do not fit"):
        load_router(out, slm=slm)


def test_router_params_features():
    assert RouterParams().features == ["hidden"] and RouterParams().ablations == []
    with pytest.raises(ValidationError, match="must contain 'hidden'"):
        RouterParams(features=["token_embedding"])
    with pytest.raises(ValidationError):
        RouterParams(features=["hidden", "entropy"])
    with pytest.raises(ValidationError, match="twice"):
        RouterParams(ablations=["emb", "emb"])
    assert set(RouterParams.model_fields["ablations"].annotation.__args__[0].__args__) == set(ABLATIONS)


def test_feature_router_drives_the_engine(tiny_pair):
    """The engine's interface is unchanged: it passes the SLM's hidden state, the wrapper computes the rest."""
    from citer.decoding.engine import RoutedEngine

    small, llm, tok = tiny_pair
    h = small.config.hidden_size
    torch.manual_seed(0)
    mlp = MLPRouter(h, input_dim=input_dim(h, FEATURES)).eval()
    router = FeatureRouter(mlp, *parts(small), FEATURES, vocab_size=len(tok)).eval()
    prompts = [tok.encode(q, add_special_tokens=False) for q in ("2+2=", "Tom has 14 coins")]
    with (
        torch.no_grad()
    ):  # center the scores on the SLM's hidden states so both models write tokens at tau 0.5
        hs = torch.cat(
            [small.get_decoder()(input_ids=torch.tensor([q])).last_hidden_state[0] for q in prompts]
        )
        mlp.net[-1].weight.mul_(8.0)
        mlp.net[-1].bias.sub_(router.logits(hs).median())
    engine = RoutedEngine(small, llm, router, tau=0.5, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    res = engine.generate_batch(prompts, max_new_tokens=12)
    flags = [f for row in res.from_llm for f in row]
    assert len(flags) > 0 and any(flags) and not all(flags)
