"""Routed engine correctness on tiny random Qwen2 models built here (seeded, CPU, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FlakyRouter, decoding_pair, make_qwen2
from torch import nn

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, ConfidenceRouter, RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40]]


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


class CountCalls:
    """Counts the engine's forward calls of one model and the batch size of each (whichever forward runs them)."""

    def __init__(self, model):
        from citer.decoding.runner import ModelRunner

        self.sizes: list[int] = []
        self._cls, self._orig = ModelRunner, ModelRunner.forward

        def counted(runner, input_ids, *args, **kwargs):
            if runner.model is model:
                self.sizes.append(input_ids.shape[0])
            return self._orig(runner, input_ids, *args, **kwargs)

        ModelRunner.forward = counted

    def close(self):
        self._cls.forward = self._orig


def test_always_llm_equals_llm_greedy_generate(pair):
    slm, llm = pair
    res = RoutedEngine(slm, llm, AlwaysLLM(), tau=0.5).generate_batch(PROMPTS, 16)
    for i, p in enumerate(PROMPTS):
        assert res.tokens[i] == hf_greedy(llm, p, 16)
        assert all(res.from_llm[i])


def test_always_slm_equals_slm_greedy_generate(pair):
    slm, llm = pair
    res = RoutedEngine(slm, llm, AlwaysSLM(), tau=0.5).generate_batch(PROMPTS, 16)
    for i, p in enumerate(PROMPTS):
        assert res.tokens[i] == hf_greedy(slm, p, 16)
        assert not any(res.from_llm[i])
    assert res.batch.llm_calls == 0 and res.batch.llm_bytes == 0.0


def test_slm_only_engine_without_llm(pair):
    slm, _ = pair
    res = RoutedEngine(slm, None, AlwaysSLM()).generate_batch(PROMPTS[:2], 8)
    assert res.tokens[0] == hf_greedy(slm, PROMPTS[0], 8)
    as_numpy = RoutedEngine(slm, None, AlwaysSLM()).generate_batch([np.array(p) for p in PROMPTS[:2]], 8)
    assert as_numpy.tokens == res.tokens
    with pytest.raises(EngineInputError, match="llm=None"):
        RoutedEngine(slm, None, RandomRouter(0.5))


class TinyMLPRouter(nn.Module):
    """Stands in for the trained MLP router: an nn.Module (B, H) -> (B,) in [0, 1]."""

    def __init__(self, h):
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(h, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, hidden):
        return torch.sigmoid(self.net(hidden)).squeeze(-1)


def routers(slm):
    return {
        "slm": (AlwaysSLM(), 0.5),
        "llm": (AlwaysLLM(), 0.5),
        "random": (RandomRouter(0.4, seed=7), 0.5),
        "conf_max": (ConfidenceRouter.from_model(slm, "max_prob"), 0.03),  # random models: flat distributions
        "conf_ent": (ConfidenceRouter.from_model(slm, "entropy"), 0.02),
        "mlp": (TinyMLPRouter(32), 0.42),
    }


@pytest.mark.parametrize("name", ["slm", "llm", "random", "conf_max", "conf_ent", "mlp"])
def test_batched_equals_one_row_at_a_time(pair, name):
    slm, llm = pair
    router, tau = routers(slm)[name]
    eng = RoutedEngine(slm, llm, router, tau=tau)
    batched = eng.generate_batch(PROMPTS, 14)
    for i, p in enumerate(PROMPTS):
        single = eng.generate(p, 14, row_ids=[i])
        assert single.tokens[0] == batched.tokens[i], (name, i)
        assert single.from_llm[0] == batched.from_llm[i], (name, i)
        assert single.rows[0].llm_calls == batched.rows[i].llm_calls
    # A genuine mix, so catch-up with mixed gaps was exercised.
    if name in ("random", "conf_max", "conf_ent", "mlp"):
        frac = batched.batch.llm_fraction
        assert 0.05 < frac < 0.95, (name, frac)


def test_sampling_is_seeded_and_batch_invariant(pair):
    slm, llm = pair
    eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=1), tau=0.5)
    kw = dict(temperature=1.5, top_p=0.9, seed=11)
    a = eng.generate_batch(PROMPTS, 12, **kw)
    assert a.tokens == eng.generate_batch(PROMPTS, 12, **kw).tokens
    for i, p in enumerate(PROMPTS):
        assert eng.generate(p, 12, row_ids=[i], **kw).tokens[0] == a.tokens[i]
    assert a.tokens != eng.generate_batch(PROMPTS, 12, temperature=1.5, top_p=0.9, seed=12).tokens
    assert a.tokens != eng.generate_batch(PROMPTS, 12).tokens  # sampling differs from greedy


def test_eager_attention_matches_sdpa(pair):
    slm, llm = pair
    eager = make_qwen2(V, hidden_size=64, num_hidden_layers=2, seed=2)
    eager.set_attn_implementation("eager")
    router = RandomRouter(0.5, seed=3)
    a = RoutedEngine(slm, llm, router, tau=0.5).generate_batch(PROMPTS, 10)
    b = RoutedEngine(slm, eager, router, tau=0.5).generate_batch(PROMPTS, 10)
    assert a.tokens == b.tokens


def test_llm_calls_per_token_within_llm_fraction(pair):
    slm, llm = pair
    counter = CountCalls(llm)
    try:
        res = RoutedEngine(slm, llm, RandomRouter(0.3, seed=5), tau=0.5).generate_batch(PROMPTS, 30)
    finally:
        counter.close()
    b = res.batch
    assert len(counter.sizes) == b.llm_calls  # the meter counts real forward calls
    assert b.llm_calls_per_token <= b.llm_fraction
    assert b.llm_calls < b.llm_tokens  # batched rows share calls
    for r in res.rows:
        assert r.llm_calls == r.llm_tokens  # one call per LLM token, never one per skipped token
        # Every token the LLM did not write and every LLM token before the last is caught up exactly once.
        assert r.llm_catchup_tokens <= r.new_tokens
    assert b.llm_catchup_tokens + b.llm_prompt_tokens + len(PROMPTS) >= b.llm_tokens


def test_eos_stops_rows_and_they_leave_the_batch(pair):
    slm, llm = pair
    free = RoutedEngine(slm, llm, AlwaysSLM()).generate_batch(PROMPTS, 12)
    eos = free.tokens[0][3]
    stop = [t.index(eos) + 1 if eos in t else 12 for t in free.tokens]
    assert stop[0] == 4 and max(stop) == 12
    counter = CountCalls(slm)
    try:
        res = RoutedEngine(slm, llm, AlwaysSLM(), eos_token_id=eos).generate_batch(PROMPTS, 12)
    finally:
        counter.close()
    for i in range(len(PROMPTS)):
        assert res.tokens[i] == free.tokens[i][: stop[i]]
        assert len(res.from_llm[i]) == len(res.tokens[i])
        assert res.rows[i].slm_calls == len(res.tokens[i])  # prefill + one step per further token
    # Calls after a row's EOS no longer include it: batch size per call is the number of rows still going
    # (the prefill, call 0, packs the mixed-length prompts into one sequence).
    expected = [sum(1 for s in stop if s > k) for k in range(max(stop))]
    assert counter.sizes[1:] == expected[1:] and len(counter.sizes) == len(expected)


def test_per_row_bytes_sum_to_batch(pair):
    slm, llm = pair
    res = RoutedEngine(slm, llm, RandomRouter(0.5, seed=2), tau=0.5).generate_batch(PROMPTS, 10)
    total = sum(r.bytes_moved for r in res.rows)
    assert total == pytest.approx(res.batch.bytes_moved, rel=1e-12)
    assert sum(r.new_tokens for r in res.rows) == res.batch.new_tokens == sum(len(t) for t in res.tokens)


@pytest.mark.parametrize(
    ("kwargs", "call", "match"),
    [
        ({}, lambda e: e.generate_batch([], 4), "empty list"),
        ({}, lambda e: e.generate_batch([[1, 2], []], 4), r"prompts\[1\]: empty prompt"),
        ({}, lambda e: e.generate_batch([[1] * 60], 10), r"prompts\[0\]: 60 tokens .* llm context .* = 54"),
        ({}, lambda e: e.generate_batch([[1, V + 3]], 4), r"prompts\[0\]: token ids outside"),
        ({}, lambda e: e.generate_batch([[1, 2]], 0), "max_new_tokens"),
        ({}, lambda e: e.generate_batch([[1, 2]], 3, top_p=0.0), "top_p"),
        ({}, lambda e: e.generate_batch([[1, 2], [3]], 3, row_ids=[4, 4]), "row_ids: need 2 distinct"),
        ({"tau": 1.5}, None, r"tau must lie in \[0, 1\]"),
        ({"tau": -0.1}, None, r"tau must lie in \[0, 1\]"),
    ],
)
def test_bad_input_raises_before_generating(pair, kwargs, call, match):
    slm, _ = pair
    llm = make_qwen2(V, hidden_size=64, num_hidden_layers=2, seed=2, max_position_embeddings=64)
    counter = CountCalls(slm)
    try:
        with pytest.raises(EngineInputError, match=match):
            eng = RoutedEngine(slm, llm, AlwaysLLM(), **{"tau": 0.5, **kwargs})
            call(eng)
    finally:
        counter.close()
    assert counter.sizes == []


def test_padded_embeddings_pair_and_a_too_large_vocabulary_is_refused(pair):
    slm, llm = pair
    padded = make_qwen2(V + 5, hidden_size=64, num_hidden_layers=2, seed=2)
    eng = RoutedEngine(slm, padded, AlwaysLLM(), tau=0.5, vocab_size=V)
    assert RoutedEngine(slm, padded, AlwaysLLM()).vocab_size == V  # default: the smaller embedding
    with pytest.raises(EngineInputError, match=r"token ids outside \[0, 97\)"):
        eng.generate_batch([[1, V + 2]], 2)
    with pytest.raises(EngineInputError, match=r"embeds 97 tokens, fewer than the tokenizer's 102"):
        RoutedEngine(slm, padded, AlwaysLLM(), vocab_size=V + 5)


def test_positions_score_with_the_engines_own_forward(pair, monkeypatch):
    """Teacher-forced passes take the forward the engine was built with: ``forward="hf"`` scores with HF's modules
    (the oracle), never the lean forward."""
    from citer.decoding.lean import LeanDecoder

    slm, llm = pair
    lean_calls = []
    lean_hidden = LeanDecoder.hidden

    def spy(self, *args, **kwargs):
        lean_calls.append(self)
        return lean_hidden(self, *args, **kwargs)

    monkeypatch.setattr(LeanDecoder, "hidden", spy)
    seqs, rows, pos = [PROMPTS[0], PROMPTS[2]], [0, 1, 1], [4, 0, 10]
    ids = torch.tensor([PROMPTS[0] + [0] * 6, PROMPTS[2]])
    eng = RoutedEngine(slm, llm, AlwaysLLM(), forward="hf")
    for which, model in (("slm", slm), ("llm", llm)):
        logits, hidden = eng.positions(which, seqs, rows, pos)
        with torch.no_grad():
            want_logits, want_hidden = model(ids).logits, model.get_decoder()(ids).last_hidden_state
        assert torch.allclose(logits, want_logits[rows, pos], atol=1e-5)
        assert torch.allclose(hidden, want_hidden[rows, pos], atol=1e-5)
    assert lean_calls == []
    RoutedEngine(slm, llm, AlwaysLLM()).positions("slm", seqs, rows, pos)
    assert lean_calls  # the default engine's pass is the lean forward's


def test_a_failed_generate_batch_leaves_the_engine_its_pools(pair):
    """After a call that failed mid-decode, the next takes the engine's own pools again, emptied, even while the
    failure (its traceback, and so the dead session) is still held."""
    slm, llm = pair
    want = RoutedEngine(slm, llm, AlwaysLLM(), tau=0.5).generate_batch(PROMPTS, 6)
    router = FlakyRouter()
    eng = RoutedEngine(slm, llm, router, tau=0.5)
    with pytest.raises(RuntimeError, match="router down") as failed:
        eng.generate_batch(PROMPTS, 6)
    router.fail = False
    sess = eng.session()
    assert eng._pools is not None and sess.slm_pool is eng._pools[0] and sess.llm_pool is eng._pools[1]
    sess.closed = True
    assert eng.generate_batch(PROMPTS, 6).tokens == want.tokens
    assert failed.value is not None
