"""Log-probs of routed decoding: per emitted token from the model that wrote it, and the routed teacher-forced score."""

from __future__ import annotations

import pytest
import torch
from conftest import decoding_pair, spread_router

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.decoding.scoring import routed_loglikelihood, routed_loglikelihood_batch

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40]]


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def _decode(eng, budgets, logprobs, **kw):
    sess = eng.session()
    keys = [
        sess.add(p, n, row_id=i, logprobs=logprobs[i], **kw)
        for i, (p, n) in enumerate(zip(PROMPTS, budgets, strict=True))
    ]
    got = {k: [] for k in keys}
    while sess.busy:
        for em in sess.step():
            got[em.key].append(em)
    return [got[k] for k in keys]


def _full_logprobs(model, seq):
    """log_softmax of ``model``'s logits at every position of ``seq`` (one plain HF forward): (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0, :, :V].float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_leave_tokens_unchanged_and_come_from_the_model_that_wrote_each_token(pair, temperature):
    slm, llm = pair
    # Shared LLM calls make rows wait: the log-probs must still be those of the logits the token was chosen from.
    eng = RoutedEngine(slm, llm, RandomRouter(0.4, seed=3), tau=0.5, llm_min_rows=2, llm_max_wait_steps=2)
    budgets = [8, 12, 6, 10]
    plain = _decode(eng, budgets, [None] * 4, temperature=temperature, seed=7)
    asked = _decode(eng, budgets, [3, None, 0, 5], temperature=temperature, seed=7)
    for i in range(4):
        assert [e.token for e in asked[i]] == [e.token for e in plain[i]], i
        assert [e.from_llm for e in asked[i]] == [e.from_llm for e in plain[i]], i
        assert all(e.logprob is None and e.top_logprobs is None for e in plain[i])
    assert all(e.logprob is None for e in asked[1])
    for i, k in ((0, 3), (2, 0), (3, 5)):
        seq = PROMPTS[i] + [e.token for e in asked[i]]
        ref = {"slm": _full_logprobs(slm, seq), "llm": _full_logprobs(llm, seq)}
        assert any(e.from_llm for e in asked[i]) or i == 2
        for j, e in enumerate(asked[i]):
            dist = ref["llm" if e.from_llm else "slm"][len(PROMPTS[i]) - 1 + j]
            assert e.logprob == pytest.approx(float(dist[e.token]), abs=1e-4), (i, j)
            assert len(e.top_logprobs) == k
            top = dist.topk(k) if k else None
            if k:
                assert [t for t, _ in e.top_logprobs] == top.indices.tolist()
                assert [lp for _, lp in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
            if temperature == 0.0 and k:
                assert e.top_logprobs[0][0] == e.token  # greedy: the token is the top one


def test_session_refuses_a_bad_logprobs_count(pair):
    slm, llm = pair
    sess = RoutedEngine(slm, llm, RandomRouter(0.4, seed=3), tau=0.5).session()
    with pytest.raises(EngineInputError, match="logprobs"):
        sess.add([1, 2], 3, logprobs=-1)


@pytest.mark.parametrize("router", ["random", "spread"])
def test_teacher_forced_score_of_a_greedy_routed_answer_replays_its_routing(pair, router):
    slm, llm = pair
    r = RandomRouter(0.4, seed=3) if router == "random" else spread_router(slm.config.hidden_size)
    eng = RoutedEngine(slm, llm, r, tau=0.5)
    for i, p in enumerate(PROMPTS):
        sess = eng.session()
        key = sess.add(p, 10, row_id=i, logprobs=0)
        ems = []
        while sess.busy:
            ems += [e for e in sess.step() if e.key == key]
        sc = routed_loglikelihood(eng, p, [e.token for e in ems], row_id=i)
        assert sc.from_llm == [e.from_llm for e in ems], i
        assert sc.greedy and all(sc.is_greedy)
        assert sc.logprobs == pytest.approx([e.logprob for e in ems], abs=1e-4)
        assert sc.total == pytest.approx(sum(e.logprob for e in ems), abs=1e-3)


def test_one_model_routers_score_with_that_model_alone(pair):
    slm, llm = pair
    prompt, cont = PROMPTS[0], [3, 4, 5, 6]
    seq = prompt + cont
    for router, model in ((AlwaysLLM(), llm), (AlwaysSLM(), slm)):
        sc = routed_loglikelihood(RoutedEngine(slm, llm, router, tau=0.5), prompt, cont, top_k=2)
        ref = _full_logprobs(model, seq)[len(prompt) - 1 : -1]
        assert sc.logprobs == pytest.approx([float(ref[j, t]) for j, t in enumerate(cont)], abs=1e-4)
        assert sc.from_llm == [model is llm] * len(cont)
        assert [[t for t, _ in top] for top in sc.top] == ref.topk(2).indices.tolist()
        assert sc.is_greedy == [int(ref[j].argmax()) == t for j, t in enumerate(cont)]
    # An SLM-only engine scores without an LLM at all.
    alone = routed_loglikelihood(RoutedEngine(slm, None, AlwaysSLM()), prompt, cont)
    assert alone.logprobs == pytest.approx(sc.logprobs, abs=1e-5)


def test_a_batch_is_one_slm_pass_and_one_llm_pass_cut_after_its_last_llm_position(pair, monkeypatch):

    slm, llm = pair
    eng = RoutedEngine(slm, llm, spread_router(slm.config.hidden_size), tau=0.5)
    items = [(p, [3, 4, 5, 6, 7]) for p in PROMPTS]
    calls: dict[str, list[tuple[int, ...]]] = {"slm": [], "llm": []}
    from citer.decoding.runner import ModelRunner

    real = ModelRunner.forward

    def counted(runner, ids, *args, **kw):  # the real forward, each call's shape noted
        calls["slm" if runner.model is slm else "llm"].append(tuple(ids.shape))
        return real(runner, ids, *args, **kw)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    batch = routed_loglikelihood_batch(eng, items, top_k=1)
    assert calls["slm"] == [(len(items), max(len(p) + len(c) for p, c in items))]
    assert len(calls["llm"]) == 1
    alone = [routed_loglikelihood(eng, p, c, top_k=1, row_id=i) for i, (p, c) in enumerate(items)]
    for b, a in zip(batch, alone, strict=True):
        assert b.from_llm == a.from_llm and b.is_greedy == a.is_greedy
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    flags = [b.from_llm for b in batch]
    assert any(any(f) for f in flags) and not all(all(f) for f in flags)  # both models scored
    need = [
        len(p) + max(j for j, f in enumerate(b.from_llm) if f)
        for (p, _), b in zip(items, batch, strict=True)
        if any(b.from_llm)
    ]
    assert calls["llm"][0] == (len(need), max(need))


def test_scoring_refuses_what_it_cannot_score(pair):
    slm, llm = pair
    eng = RoutedEngine(slm, llm, AlwaysLLM(), tau=0.5)
    with pytest.raises(EngineInputError, match="empty prompt"):
        routed_loglikelihood(eng, [], [1])
    with pytest.raises(EngineInputError, match="empty continuation"):
        routed_loglikelihood(eng, [1], [])
    with pytest.raises(EngineInputError, match="longer than"):
        routed_loglikelihood(eng, [1] * 600, [2])
