"""Verified routing: a catch-up checks the SLM's tokens, a cut rewinds the row to the state the LLM's token would have
left, the window and the final check call the LLM when stated, and only final tokens leave the session."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decoding_pair, spread_router

from citer.decoding.baselines import AlwaysSLM, RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.evaluation.oracle import OracleRouter

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40], [3, 4, 5], [60, 61]]
N = 24


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def engine(pair, router, tau=0.5, **kw):
    slm, llm = pair
    return RoutedEngine(slm, llm, router, tau=tau, vocab_size=V, **kw)


def replayed(pair, res, **kw):
    """Plain CITER forced to the LLM exactly where the verified run's final tokens are the LLM's."""
    return engine(pair, OracleRouter(res.from_llm)).generate_batch(PROMPTS, N, **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("window,final", [(0, False), (3, True)])
def test_a_verified_run_equals_plain_citer_sent_to_the_llm_where_it_took_the_llms_token(
    pair, temperature, window, final
):
    router = spread_router(32)
    eng = engine(pair, router, verify_rho=1.0, verify_window=window, verify_final=final)
    res = eng.generate_batch(PROMPTS, N, temperature=temperature, seed=3)
    cut = sum(r.rolled_back_tokens for r in res.rows)
    assert cut > 0 and any(res.replaced)  # the check did take tokens back, so the comparison means something
    assert cut == sum(len(t) for row in res.replaced for _, t in row)
    plain = replayed(pair, res, temperature=temperature, seed=3)
    assert plain.tokens == res.tokens
    assert plain.from_llm == res.from_llm
    for st, toks in zip(res.rows, res.tokens, strict=True):
        assert st.new_tokens == len(toks)


def test_rho_inf_is_plain_citer_and_rho_zero_with_the_router_off_is_the_llms_greedy_answer(pair):
    slm, llm = pair
    router = RandomRouter(0.3, seed=5)
    plain = engine(pair, router).generate_batch(PROMPTS, N)
    assert engine(pair, router, verify_rho=math.inf).generate_batch(PROMPTS, N).tokens == plain.tokens
    llm_only = RoutedEngine(llm, None, AlwaysSLM(), vocab_size=V).generate_batch(PROMPTS, N)
    for window in (1, 4):
        spec = engine(pair, AlwaysSLM(), verify_rho=0.0, verify_window=window, verify_final=True)
        res = spec.generate_batch(PROMPTS, N)
        assert res.tokens == llm_only.tokens  # lossless: every SLM token the LLM would not write is replaced
    # a drafter that agrees with the LLM keeps every draft: one call per window + 1 tokens
    same = RoutedEngine(llm, llm, AlwaysSLM(), vocab_size=V, verify_rho=0.0, verify_window=3)
    res = same.generate_batch(PROMPTS, N)
    assert res.tokens == llm_only.tokens
    assert all(st.llm_calls == N // 4 and st.rolled_back_tokens == 0 for st in res.rows)


def test_the_window_calls_the_llm_every_w_unverified_tokens_and_keeps_tokens_it_accepts(pair):
    slm, _ = pair
    slm_only = RoutedEngine(slm, None, AlwaysSLM(), vocab_size=V).generate_batch(PROMPTS, N)
    for window in (2, 3, 5):
        # rho so large nothing is rejected: every check keeps the SLM's tokens, so only the call count changes
        res = engine(pair, AlwaysSLM(), verify_rho=1e9, verify_window=window).generate_batch(PROMPTS, N)
        assert res.tokens == slm_only.tokens
        assert not any(any(f) for f in res.from_llm)
        for st in res.rows:
            # a check runs with `window` tokens pending and verifies the step's proposal too
            assert st.llm_calls == N // (window + 1)
            assert st.rolled_back_tokens == 0


def test_the_final_check_verifies_the_tail_before_a_row_ends(pair):
    res = engine(pair, AlwaysSLM(), verify_rho=1e9, verify_final=True).generate_batch(PROMPTS, N)
    assert all(st.llm_calls == 1 for st in res.rows)  # one call, at the last budgeted token
    off = engine(pair, AlwaysSLM(), verify_rho=1e9).generate_batch(PROMPTS, N)
    assert all(st.llm_calls == 0 for st in off.rows)


def test_only_final_tokens_leave_the_session(pair):
    eng = engine(pair, AlwaysSLM(), verify_rho=1e9, verify_window=3)
    sess = eng.session()
    key = sess.add(PROMPTS[0], 10, row_id=0)
    sizes = []
    while sess.busy:
        out = sess.step()
        if out:
            assert all(em.key == key for em in out)
            sizes.append(len(out))
    # three provisional tokens wait for the check that also verifies the fourth; the row's end releases the rest
    assert sizes == [4, 4, 2]


def test_a_cut_rewinds_both_caches_to_the_state_the_llms_token_would_have_left(pair):
    router = spread_router(32)
    ver = engine(pair, router, verify_rho=1.0, verify_window=4)
    a = ver.session()
    ka = a.add(PROMPTS[2], N, row_id=0)
    final, flags = [], []
    while a.busy:
        out = a.step()
        final += [em.token for em in out]
        flags += [em.from_llm for em in out]
        if any(em.replaced for em in out):
            break
    assert a.busy, "no cut happened before the row ended"
    row = a.rows[0]
    assert row.seq[row.prompt_len :] == final  # the cut's token is final; nothing provisional is left
    b = engine(pair, OracleRouter([flags])).session()
    kb = b.add(PROMPTS[2], N, row_id=0)
    got = []
    while len(got) < len(final):
        got += [em.token for em in b.step() if em.key == kb]
    assert got == final and ka == kb == 0
    rb = b.rows[0]
    assert (row.llm_seen, a.slm_pool.lengths[0], a.llm_pool.lengths[0]) == (
        rb.llm_seen,
        b.slm_pool.lengths[0],
        b.llm_pool.lengths[0],
    )
    for ca, cb in ((a.slm_pool, b.slm_pool), (a.llm_pool, b.llm_pool)):
        n = ca.lengths[0]
        for ka_, kb_ in zip(ca.keys + ca.values, cb.keys + cb.values, strict=True):
            torch.testing.assert_close(ka_[0, :, :n], kb_[0, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.logits[0], b.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.hidden[0], b.hidden[0], atol=1e-5, rtol=1e-5)


def test_rolled_back_steps_stay_charged(pair):
    res = engine(pair, spread_router(32), verify_rho=1.0).generate(PROMPTS[0], N)
    st = res.rows[0]
    assert st.rolled_back_tokens > 0
    # one prefill, then every token fed to the SLM -- the final ones but the last, and every one taken back
    assert st.slm_calls == 1 + (st.new_tokens - 1) + st.rolled_back_tokens
    assert res.batch.rolled_back_tokens == st.rolled_back_tokens


@pytest.mark.parametrize(
    "kw",
    [
        {"verify_rho": -1.0},
        {"verify_rho": "1"},
        {"verify_window": 3},
        {"verify_final": True},
        {"verify_rho": 1.0, "verify_window": -1},
        {"verify_rho": 1.0, "verify_window": 1.5},
    ],
)
def test_bad_verification_settings_are_refused_by_name(pair, kw):
    with pytest.raises(EngineInputError, match="verify_"):
        engine(pair, AlwaysSLM(), **kw)


def test_fixed_shape_steps_verify_like_the_ragged_calls(pair):
    router = spread_router(32)
    kw = dict(verify_rho=1.0, verify_window=3, verify_final=True)
    ragged = engine(pair, router, **kw).generate_batch(PROMPTS, N)
    fixed = engine(pair, router, forward="fixed", **kw).generate_batch(PROMPTS, N)
    assert fixed.tokens == ragged.tokens and fixed.replaced == ragged.replaced


def test_a_setting_survives_the_registry_tags():
    from citer.decoding.verify import Verification, VerificationError

    for v in (Verification(), Verification(0.5, 4, True), Verification(2.0, 0, False)):
        assert Verification.from_tags(v.tags()) == v
        assert all(isinstance(x, str) for x in v.tags().values())  # MLflow tags are strings
    assert Verification.from_tags({"tau": "0.5"}) == Verification()  # none recorded: plain CITER
    with pytest.raises(VerificationError, match="verify_window"):
        Verification.from_tags({"verify_rho": "1.0", "verify_window": "-2"})


def test_a_draft_leads_the_row_and_a_check_may_take_it_back(pair):
    slm, llm = pair
    plain = engine(pair, AlwaysSLM())
    first = plain.generate(PROMPTS[0], N).tokens[0]
    bad = (first[0] + 1) % V  # a first token the SLM would not write
    rest = plain.generate(PROMPTS[0] + [bad], N - 1).tokens[0]
    assert plain.generate_batch([PROMPTS[0]], N, drafts=[[bad]]).tokens[0] == [bad, *rest]
    llm_only = RoutedEngine(llm, None, AlwaysSLM(), vocab_size=V).generate(PROMPTS[0], N).tokens[0]
    checked = engine(pair, AlwaysSLM(), verify_rho=0.0, verify_window=2, verify_final=True)
    res = checked.generate_batch([PROMPTS[0]], N, drafts=[[bad]])
    if llm_only[0] != bad:
        assert res.tokens[0] == llm_only and res.replaced[0][0][0] == 0  # the draft itself was taken back
    with pytest.raises(EngineInputError, match="draft"):
        plain.generate_batch([PROMPTS[0]], 2, drafts=[[1, 2]])


@pytest.mark.parametrize("n_draft", [1, 3, 6])
def test_every_draft_token_is_counted_once(pair, n_draft):
    """A draft's tokens reach the meter together (one row repeated); each counts, at any length."""
    res = engine(pair, AlwaysSLM()).generate_batch([PROMPTS[0]], 9, drafts=[[1] * n_draft])
    st = res.rows[0]
    assert len(res.tokens[0]) == st.new_tokens == st.slm_tokens == 9 and st.llm_tokens == 0
