"""The step-level scheduler: rows joining a running batch, slots reused, shared LLM calls -- tokens never change."""

from __future__ import annotations

import pytest
import torch
from conftest import decoding_pair

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.decoding.kv_pool import KVPool
from citer.decoding.runner import ModelRunner
from citer.routing.mlp import MLPRouter

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40], [3, 4, 5], [60, 61]]


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def alone(eng, i, n, **kw):
    return eng.generate(PROMPTS[i], n, row_ids=[i], **kw)


@pytest.mark.parametrize("max_rows", [1, 2, 4])
def test_rows_joining_as_others_finish_get_the_tokens_they_get_alone(pair, max_rows):
    slm, llm = pair
    eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=5), tau=0.5, eos_token_id=[7, 50])
    budgets = [4, 9, 6, 12, 3, 8]  # rows end at different steps, so slots are freed and refilled mid-batch
    sess = eng.session(max_rows=max_rows)
    keys = [sess.add(p, n, row_id=i) for i, (p, n) in enumerate(zip(PROMPTS, budgets, strict=True))]
    got: dict[int, list[int]] = {k: [] for k in keys}
    peak = 0
    while sess.busy:
        for em in sess.step():
            got[em.key].append(em.token)
        peak = max(peak, len(sess.rows))
    assert peak <= 2 * max_rows  # the SLM's batch holds max_rows; rows waiting for the LLM are beside it
    for i, k in enumerate(keys):
        assert got[k] == alone(eng, i, budgets[i]).tokens[0], i


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_row_waiting_for_the_llm_leaves_the_slm_batch_to_a_newcomer(pair, temperature):
    """max_rows bounds the SLM's batch: while routed rows wait for a shared LLM call, queued rows are admitted in
    their places (live rows above max_rows, never above twice it), and every row's tokens, greedy or sampled, are
    those it gets alone."""
    slm, llm = pair
    eng = RoutedEngine(
        slm,
        llm,
        RandomRouter(0.3, seed=5),
        tau=0.5,
        llm_min_rows=8,
        llm_max_wait_steps=3,
        eos_token_id=[7, 50],
    )
    budgets = [10, 9, 12, 11, 10, 8]
    sess = eng.session(max_rows=2, temperature=temperature, seed=4)
    keys = [sess.add(p, n, row_id=i) for i, (p, n) in enumerate(zip(PROMPTS, budgets, strict=True))]
    got: dict[int, list[int]] = {k: [] for k in keys}
    live, admitted_beside_a_wait = 0, False
    while sess.busy:
        waiting_before = len(sess.rows) - sess.stepping
        queued_before = len(sess.queue)
        for em in sess.step():
            got[em.key].append(em.token)
        admitted_beside_a_wait |= waiting_before > 0 and len(sess.queue) < queued_before
        live = max(live, len(sess.rows))
    assert admitted_beside_a_wait and 2 < live <= 4
    for i, k in enumerate(keys):
        ref = eng.generate(PROMPTS[i], budgets[i], row_ids=[i], temperature=temperature, seed=4)
        assert got[k] == ref.tokens[0], i


def test_a_row_added_mid_flight_matches_the_row_alone_and_streams_token_by_token(pair):
    slm, llm = pair
    eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=5), tau=0.5)
    sess = eng.session()
    a = sess.add(PROMPTS[0], 10, row_id=0)
    seen: dict[int, list[int]] = {a: []}
    for _ in range(4):
        for em in sess.step():
            seen[em.key].append(em.token)
    assert len(seen[a]) == 4  # one token per row per step, as it is chosen
    b = sess.add(PROMPTS[2], 10, row_id=2)
    seen[b] = []
    while sess.busy:
        for em in sess.step():
            seen[em.key].append(em.token)
            assert not em.done or len(seen[em.key]) == 10
    assert seen[a] == alone(eng, 0, 10).tokens[0]
    assert seen[b] == alone(eng, 2, 10).tokens[0]
    assert sess.stats(b).new_tokens == 10


def test_cancel_frees_the_slot_and_leaves_the_others_untouched(pair):
    slm, llm = pair
    eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=5), tau=0.5)
    sess = eng.session(max_rows=2)
    keys = [sess.add(PROMPTS[i], 8, row_id=i) for i in range(3)]
    got: dict[int, list[int]] = {k: [] for k in keys}
    for em in sess.step():
        got[em.key].append(em.token)
    assert sess.cancel(keys[0]) and not sess.cancel(keys[0])
    while sess.busy:
        for em in sess.step():
            got[em.key].append(em.token)
    assert len(got[keys[0]]) == 1
    for i in (1, 2):
        assert got[keys[i]] == alone(eng, i, 8).tokens[0]


@pytest.mark.parametrize("min_rows,max_wait", [(2, 3), (4, 8), (32, 2)])
def test_shared_llm_calls_change_no_token_and_cut_llm_calls(pair, min_rows, max_wait):
    slm, llm = pair
    prompts = [[(7 * i + j) % V for j in range(3 + i % 5)] for i in range(16)]
    base = RoutedEngine(slm, llm, RandomRouter(0.15, seed=2), tau=0.5)
    shared = RoutedEngine(
        slm, llm, RandomRouter(0.15, seed=2), tau=0.5, llm_min_rows=min_rows, llm_max_wait_steps=max_wait
    )
    a, b = base.generate_batch(prompts, 20), shared.generate_batch(prompts, 20)
    assert b.tokens == a.tokens and b.from_llm == a.from_llm
    assert b.batch.llm_tokens == a.batch.llm_tokens
    assert b.batch.llm_calls < a.batch.llm_calls
    assert b.batch.wait_row_steps > 0 and a.batch.wait_row_steps == 0
    assert b.batch.wait_row_steps == sum(r.wait_steps for r in b.rows)
    assert max(r.wait_steps for r in b.rows) <= max_wait * max(r.llm_tokens for r in b.rows)
    # Per-row catch-up is the same, so the row priced alone is the same; held rows add only KV reads.
    for ra, rb in zip(a.rows, b.rows, strict=True):
        assert rb.llm_calls == ra.llm_calls and rb.bytes_alone == pytest.approx(ra.bytes_alone)
    assert b.batch.llm_bytes < a.batch.llm_bytes


def test_shared_calls_bring_llm_calls_per_step_down_at_batch_32(pair):
    slm, llm = pair
    prompts = [[(3 * i + j) % V for j in range(4)] for i in range(32)]
    kw = dict(tau=0.5)
    a = RoutedEngine(slm, llm, RandomRouter(0.1, seed=1), **kw).generate_batch(prompts, 24)
    b = RoutedEngine(slm, llm, RandomRouter(0.1, seed=1), llm_min_rows=8, llm_max_wait_steps=4, **kw)
    b = b.generate_batch(prompts, 24)
    assert a.batch.llm_calls_per_step > 0.8  # some row needs the LLM at almost every step
    assert b.batch.llm_calls_per_step <= 0.4
    assert b.tokens == a.tokens


def test_always_llm_with_shared_calls_is_still_llm_greedy(pair):
    slm, llm = pair
    a = RoutedEngine(slm, llm, AlwaysLLM()).generate_batch(PROMPTS, 8)
    b = RoutedEngine(slm, llm, AlwaysLLM(), llm_min_rows=4, llm_max_wait_steps=2).generate_batch(PROMPTS, 8)
    assert a.tokens == b.tokens and b.batch.llm_calls == a.batch.llm_calls


@pytest.mark.parametrize("bad", [dict(llm_min_rows=0), dict(llm_max_wait_steps=-1), dict(llm_min_rows=True)])
def test_bad_shared_call_params_are_refused(pair, bad):
    slm, llm = pair
    with pytest.raises(EngineInputError, match=next(iter(bad))):
        RoutedEngine(slm, llm, RandomRouter(0.1), **bad)


def test_slot_pool_grows_recycles_and_keeps_rows_exact(pair):
    _, llm = pair
    ref = KVPool(llm, 3, 32)
    ref_lg, _ = ModelRunner(llm).feed(ref, [PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    pool = KVPool(llm, 0, 4)
    pool.ensure_capacity(20)
    s = pool.add_slots(2)
    ModelRunner(llm).feed(pool, [PROMPTS[3], PROMPTS[0]], slots=s)
    s = pool.add_slots(2)  # the pool doubles
    ModelRunner(llm).feed(pool, [PROMPTS[1], PROMPTS[2]], slots=s)
    moved = pool.remove_slots([0])  # slot 3 (PROMPTS[2]) moves into the hole
    assert moved == {3: 0} and pool.lengths == [len(PROMPTS[2]), len(PROMPTS[0]), len(PROMPTS[1])]
    # Held rows (empty chunks) ride along and write nothing.
    lg, _ = ModelRunner(llm).feed(pool, [[30], [], [31]])
    assert pool.lengths == [len(PROMPTS[2]) + 1, len(PROMPTS[0]), len(PROMPTS[1]) + 1]
    ref_next, _ = ModelRunner(llm).feed(ref, [[31], [30]], slots=[1, 2])
    torch.testing.assert_close(lg[0], ref_next[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lg[2], ref_next[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="nothing to feed"):
        ModelRunner(llm).feed(pool, [[], []], slots=[0, 1])
    assert ref_lg.shape[0] == 3


# ------------------------------------------------------------- what each scheduler decision guarantees (scripts/mutation.py)


@pytest.mark.parametrize("temperature,top_p", [(-0.1, 1.0), (0.5, 0.0), (0.5, 1.5)])
def test_a_row_with_bad_sampling_settings_is_refused(pair, temperature, top_p):
    sess = RoutedEngine(*pair, RandomRouter(0.3, seed=5), tau=0.5).session()
    with pytest.raises(EngineInputError, match="need temperature >= 0 and 0 < top_p <= 1"):
        sess.add(PROMPTS[0], 3, temperature=temperature, top_p=top_p)
    sess.add(PROMPTS[0], 3, temperature=0.0, top_p=1.0)  # both bounds are allowed


def test_rows_with_their_own_sampling_settings_share_a_batch_and_keep_their_tokens(pair):
    """A step samples each distinct (temperature, top_p, seed) group on its own; every row gets its tokens alone."""
    eng = RoutedEngine(*pair, RandomRouter(0.3, seed=5), tau=0.5)
    settings = [
        {},
        dict(temperature=0.9, seed=1),
        dict(temperature=0.9, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=1),
        dict(temperature=0.9, seed=1),  # the same group as row 1
        {},
    ]
    budgets = [7, 10, 9, 6, 10, 8]
    sess = eng.session()
    keys = [sess.add(PROMPTS[i], budgets[i], row_id=i, **settings[i]) for i in range(len(PROMPTS))]
    got: dict[int, list[int]] = {k: [] for k in keys}
    while sess.busy:
        for em in sess.step():
            got[em.key].append(em.token)
            assert em.done is (len(got[em.key]) == budgets[keys.index(em.key)])
    for i, k in enumerate(keys):
        alone_ = eng.generate(PROMPTS[i], budgets[i], row_ids=[i], **settings[i])
        assert got[k] == alone_.tokens[0], i
        st = sess.stats(k)
        assert st.new_tokens == budgets[i] and st.llm_tokens == sum(alone_.from_llm[0]), i
    assert got[keys[1]] != got[keys[4]]  # same settings, other row: its own draws


def test_the_meter_prices_both_models_for_the_engines_gpu(pair):
    eng = RoutedEngine(*pair, RandomRouter(0.3, seed=5), tau=0.5, gpu="H200")
    sess = eng.session()
    key = sess.add(PROMPTS[0], 8, row_id=0)
    while sess.busy:
        sess.step()
    st = sess.stats(key)
    assert st.slm_bytes > 0 and st.llm_bytes > 0
    assert st.projected_seconds == pytest.approx(st.bytes_moved / 4.8e12)


def test_a_row_waiting_alone_is_served_at_once_when_nothing_else_moves(pair):
    eng = RoutedEngine(*pair, AlwaysLLM(), llm_min_rows=8, llm_max_wait_steps=100)
    sess = eng.session()
    key = sess.add(PROMPTS[0], 5)
    for _ in range(5):
        assert [(e.key, e.from_llm) for e in sess.step()] == [(key, True)]
    assert not sess.busy


def test_no_step_ends_with_llm_min_rows_rows_held(pair):
    """As soon as ``llm_min_rows`` rows wait, the LLM is called: only fewer rows are ever held over a step."""
    slm, llm = pair
    prompts = [[(7 * i + j) % V for j in range(3 + i % 5)] for i in range(16)]
    eng = RoutedEngine(slm, llm, RandomRouter(0.1, seed=2), tau=0.5, llm_min_rows=2, llm_max_wait_steps=50)
    sess = eng.session()
    for i, p in enumerate(prompts):
        sess.add(p, 20, row_id=i)
    held_at = []
    while sess.busy:
        sess.step()
        held_at.append(sum(r.waited >= 0 for r in sess.rows))
    assert max(held_at) == 1  # rows are held, one at a time


def test_a_token_routed_to_a_missing_llm_is_an_error(pair):
    slm, _ = pair
    eng = RoutedEngine(slm, None, AlwaysSLM())
    eng.tau = 2.0  # above every score: the router now sends every token to the LLM the engine does not have
    with pytest.raises(ValueError, match="^router sent a token to the LLM but the engine has llm=None$"):
        eng.generate(PROMPTS[0], 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("router", ["slm", "mlp"])
def test_a_step_without_an_llm_call_reads_the_device_once(pair, monkeypatch, temperature, router):
    """The proposals and the router's flags come back to the host in one read per step (on a GPU each read is a
    sync); a step whose rows all stay with the SLM makes no other read."""
    slm, llm = pair
    # A learned router at tau = 0 scores every row above tau: it runs each step and never sends.
    mlp = MLPRouter(slm.config.hidden_size).eval()
    eng = RoutedEngine(slm, llm, AlwaysSLM() if router == "slm" else mlp, tau=0.0)
    sess = eng.session(temperature=temperature)
    for i in range(3):
        sess.add(PROMPTS[i], 6, row_id=i)
    sess.step()  # admission: the prefill
    reads: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            reads.append(_name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    for _ in range(3):
        reads.clear()
        assert len(sess.step()) == 3
        assert reads == ["tolist"]
