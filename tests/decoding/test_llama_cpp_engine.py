"""``engine.runner: llama_cpp`` through the pipeline: :class:`LlamaCppEngine` (the routed engine's batch interface on
llama.cpp) writes the torch engine's tokens with costs metered alike, ``route_engine`` builds it from the params, and
the sweep decodes every pass on it. Skips in one line without ``llama-cpp-python``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import FlakyRouter, answering_rows

from citer.config import SweepParams
from citer.config.serving import EngineParams
from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import RoutedEngine
from citer.decoding.llama_cpp_runner import missing
from citer.decoding.rows import EngineInputError

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


@pytest.fixture()
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CITER_GGUF_CACHE", str(tmp_path / "gguf"))
    return tmp_path / "gguf"


def _engine(pair, router, gguf_cache, qtype="F32", **kw):
    from citer.decoding.llama_cpp_engine import LlamaCppEngine
    from citer.models.to_gguf import gguf_for

    return LlamaCppEngine(gguf_for(pair.slm, qtype), gguf_for(pair.llm, qtype), router, 0.5,
                          pair.tok.eos_token_id, len(pair.tok), **kw)  # fmt: skip


def _prompts(tok, n=6):
    return [tok.encode(f"{r['problem']}=", add_special_tokens=False) for r in answering_rows(21, n)]


def test_engine_writes_the_torch_engines_tokens_and_meters_its_calls(answering_pair, gguf_cache):
    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    prompts = _prompts(p.tok)
    want = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok)).generate_batch(
        prompts, 10, row_ids=list(range(10, 16))
    )
    eng = _engine(p, router, gguf_cache)
    got = eng.generate_batch(prompts, 10, row_ids=list(range(10, 16)))
    assert got.tokens == want.tokens and got.from_llm == want.from_llm
    for toks, flags, st, prompt, ref in zip(
        got.tokens, got.from_llm, got.rows, prompts, want.rows, strict=True
    ):
        assert st.new_tokens == len(toks) and st.llm_tokens == sum(flags)
        # the KV each call reads and writes, counted as the torch engine counts it (columns after the call + new)
        assert (st.slm_kv_tokens, st.llm_kv_tokens) == (ref.slm_kv_tokens, ref.llm_kv_tokens)
        assert st.slm_calls == len(toks)  # one SLM step per token written
        assert st.llm_calls == sum(flags)  # one catch-up per routed token (no shared calls)
        assert st.llm_prompt_tokens == (len(prompt) if any(flags) else 0)
        # the bytes as the meter prices calls: each call reads the file's weights (+ the router on SLM steps)
        weights = st.slm_calls * eng.cost_slm.weight_bytes + st.llm_calls * eng.cost_llm.weight_bytes
        kv = (
            st.slm_kv_tokens * eng.cost_slm.kv_bytes_per_token
            + st.llm_kv_tokens * eng.cost_llm.kv_bytes_per_token
        )
        assert math.isclose(st.bytes_alone, weights + kv)
    assert got.batch.llm_tokens == sum(map(sum, got.from_llm)) > 0
    # continuous batching: two rows at a time, rows joining as others finish, the same tokens
    assert eng.generate_batch(prompts, 10, row_ids=list(range(10, 16)), max_rows=2).tokens == want.tokens


def test_shared_llm_calls_move_when_tokens_arrive_never_which(answering_pair, gguf_cache):
    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    prompts, ids = _prompts(p.tok, 8), list(range(20, 28))
    at_once = _engine(p, router, gguf_cache).generate_batch(prompts, 10, row_ids=ids, max_rows=4)
    shared_eng = _engine(p, router, gguf_cache, llm_min_rows=4, llm_max_wait_steps=3)
    shared = shared_eng.generate_batch(prompts, 10, row_ids=ids, max_rows=4)
    assert shared.tokens == at_once.tokens and shared.from_llm == at_once.from_llm
    assert shared.batch.llm_calls < at_once.batch.llm_calls and shared.batch.wait_row_steps > 0
    # the torch engine under the same rule writes the same tokens
    torch_eng = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok),
                             llm_min_rows=4, llm_max_wait_steps=3)  # fmt: skip
    assert torch_eng.generate_batch(prompts, 10, row_ids=ids, max_rows=4).tokens == shared.tokens
    # the measured rule too (it only moves calls)
    measured = _engine(p, router, gguf_cache, llm_schedule="measured")
    assert measured.generate_batch(prompts, 10, row_ids=ids, max_rows=4).tokens == shared.tokens


def test_the_llm_reads_prompts_at_admission_and_writes_the_same_tokens(answering_pair, gguf_cache):
    """``llm_prefill="admit"`` on llama.cpp (F32): the same tokens as reading each prompt at the row's first
    catch-up, every prompt token read by the LLM once, and the same counts as the torch engine under that option."""
    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    prompts, ids = _prompts(p.tok, 8), list(range(20, 28))
    lazy = _engine(p, router, gguf_cache).generate_batch(prompts, 10, row_ids=ids, max_rows=4)
    admit = _engine(p, router, gguf_cache, llm_prefill="admit").generate_batch(
        prompts, 10, row_ids=ids, max_rows=4
    )
    assert admit.tokens == lazy.tokens and admit.from_llm == lazy.from_llm
    assert admit.batch.llm_prompt_tokens == sum(len(q) - 1 for q in prompts) + sum(
        1 for flags in lazy.from_llm if any(flags)
    )  # at admission all but the last token, which a routed row's first catch-up reads
    assert admit.batch.llm_catchup_tokens == lazy.batch.llm_catchup_tokens
    want = RoutedEngine(
        p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok), llm_prefill="admit"
    )
    ref = want.generate_batch(prompts, 10, row_ids=ids, max_rows=4)
    assert ref.tokens == admit.tokens
    assert [(r.llm_calls, r.llm_kv_tokens, r.llm_prompt_tokens) for r in admit.rows] == [
        (r.llm_calls, r.llm_kv_tokens, r.llm_prompt_tokens) for r in ref.rows
    ]
    with pytest.raises(EngineInputError, match="llm_prefill"):
        _engine(p, router, gguf_cache, llm_prefill="eager")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("rho,window,final", [(1.0, 0, False), (0.5, 3, True)])
def test_verified_routing_writes_and_takes_back_what_the_torch_engine_does(
    answering_pair, gguf_cache, temperature, rho, window, final
):
    """Verified routing on llama.cpp (F32 files): the torch engine's tokens, the same tokens taken back at the same
    places, the same calls -- shared calls and a row limit included -- and drafts a check may take back."""
    p = answering_pair
    router = RandomRouter(0.2, seed=3)
    prompts, ids = _prompts(p.tok, 6), list(range(40, 46))
    kw = dict(verify_rho=rho, verify_window=window, verify_final=final)
    want = RoutedEngine(
        p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok), **kw
    ).generate_batch(prompts, 12, temperature=temperature, seed=5, row_ids=ids)
    got = _engine(p, router, gguf_cache, **kw).generate_batch(prompts, 12, temperature=temperature, seed=5,
                                                              row_ids=ids)  # fmt: skip
    assert got.tokens == want.tokens and got.from_llm == want.from_llm and got.replaced == want.replaced
    assert sum(map(len, got.replaced)) > 0  # some rows were cut: the rewind ran
    for g, w in zip(got.rows, want.rows, strict=True):
        assert (g.rolled_back_tokens, g.llm_calls, g.slm_calls) == (
            w.rolled_back_tokens,
            w.llm_calls,
            w.slm_calls,
        )
    shared = _engine(p, router, gguf_cache, llm_min_rows=3, llm_max_wait_steps=2, **kw).generate_batch(
        prompts, 12, temperature=temperature, seed=5, row_ids=ids, max_rows=3
    )
    assert shared.tokens == want.tokens  # shared calls and turns move when tokens arrive, never which
    drafts = [[t] * 2 for t in (5, 6, 7, 8, 9, 10)]
    want_d = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok), **kw)
    got_d = _engine(p, router, gguf_cache, **kw).generate_batch(prompts, 12, row_ids=ids, drafts=drafts)
    assert got_d.tokens == want_d.generate_batch(prompts, 12, row_ids=ids, drafts=drafts).tokens


def test_a_drafted_row_fills_the_context_it_was_sized_for(answering_pair, gguf_cache):
    """A draft counts inside the row's budget: a prompt plus budget of exactly the context's 64 tokens per row is
    admitted with a draft, and finishes."""
    p = answering_pair
    eng = _engine(p, RandomRouter(0.3, seed=4), gguf_cache, verify_rho=1.0)
    prompt = _prompts(p.tok, 1)[0]
    budget = 64 - len(prompt)
    sess = eng.session()
    key = sess.add(prompt, budget, draft=[5, 6])
    for _ in range(budget + 1):  # at most one step a token
        sess.step()
        if not sess.busy:
            break
    assert not sess.busy and eng.slm.row_tokens == 64
    assert 1 <= sess.stats(key).new_tokens <= budget


def test_a_session_admits_steps_and_cancels_rows_as_serve_drives_it(answering_pair, gguf_cache):
    from citer.decoding.session import DecodeSession

    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    prompts = _prompts(p.tok, 5)
    eng = _engine(p, router, gguf_cache, llm_min_rows=2, llm_max_wait_steps=2)
    alone = [eng.generate_batch([q], 10, row_ids=[30 + i]).tokens[0] for i, q in enumerate(prompts)]
    torch_eng = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok))
    # the row cancelled before the third step: one that writes at least three tokens is still there in both drives
    # (the trained pair's answers, so their lengths, depend on the CPU it trained on)
    victim = max(range(3), key=lambda i: len(alone[i]))
    assert len(alone[victim]) >= 3

    def drive(sess):
        keys = {sess.add(q, 10, row_id=30 + i, logprobs=2): i for i, q in enumerate(prompts[:3])}
        got: dict[int, list] = {}
        live, step = [], 0
        while sess.busy:
            if step == 2:  # a request arrives mid-way, another leaves
                keys[sess.add(prompts[3], 10, row_id=33, logprobs=2)] = 3
                keys[sess.add(prompts[4], 10, row_id=34, logprobs=2)] = 4
                assert sess.cancel(next(k for k, i in keys.items() if i == victim))
            for em in sess.step():
                got.setdefault(keys[em.key], []).append(em)
            live.append(len(sess.rows))
            assert len(sess.rows) <= 4  # twice max_rows: what the contexts hold
            step += 1
        return got, live

    got, live = drive(eng.session(max_rows=2))
    ref, _ = drive(DecodeSession(torch_eng, max_rows=2))
    for i in sorted({0, 1, 2, 3, 4} - {victim}):
        assert [e.token for e in got[i]] == alone[i] == [e.token for e in ref[i]]
        assert got[i][-1].done and not any(e.done for e in got[i][:-1])
        # log-probs of the model that wrote each token; llama.cpp keeps its KV cache in F16 (its default), so they
        # differ from torch's float32 in the third decimal (2.6e-3 seen on an AMX Xeon's AVX-512 kernels)
        for a, b in zip(got[i], ref[i], strict=True):
            assert a.from_llm == b.from_llm and math.isclose(a.logprob, b.logprob, abs_tol=5e-3)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert len(got.get(victim, [])) < len(alone[victim])  # cancelled after two steps
    assert max(live) > 2  # rows waiting for the LLM left the SLM's batch to admitted ones


def test_a_second_live_session_decodes_on_contexts_of_its_own(answering_pair, gguf_cache):
    p = answering_pair
    eng = _engine(p, RandomRouter(0.3, seed=4), gguf_cache)
    prompts = _prompts(p.tok, 4)
    want = eng.generate_batch(prompts, 10).tokens
    first, second = eng.session(), eng.session()
    mine, theirs = first.slm_pool.model, second.slm_pool.model
    assert theirs is not mine and theirs._model is mine._model  # the weights loaded once
    keys = [(first, first.add(q, 10, row_id=i)) if i % 2 == 0 else (second, second.add(q, 10, row_id=i))
            for i, q in enumerate(prompts)]  # fmt: skip
    out: dict[tuple[int, int], list[int]] = {}
    while first.busy or second.busy:
        for sess in (first, second):
            for em in sess.step():
                out.setdefault((id(sess), em.key), []).append(em.token)
    assert [out[(id(s), k)] for s, k in keys] == want


def test_a_failed_call_leaves_the_engine_its_contexts(answering_pair, gguf_cache):
    """After a call that failed mid-decode the engine lends its own contexts again, emptied, even while the failure
    (and so the dead session) is still held."""
    p = answering_pair
    prompts = _prompts(p.tok, 3)
    router = FlakyRouter()
    eng = _engine(p, router, gguf_cache)
    with pytest.raises(RuntimeError, match="router down") as failed:
        eng.generate_batch(prompts, 6)
    router.fail = False
    sess = eng.session()
    assert sess.slm_pool.model is eng.slm and sess.llm_pool.model is eng.llm and failed.value is not None
    sess.closed = True
    torch_eng = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok))
    assert eng.generate_batch(prompts, 6).tokens == torch_eng.generate_batch(prompts, 6).tokens


def test_max_rows_and_vocab_size_are_refused_as_the_torch_engine_refuses_them(answering_pair, gguf_cache):
    from citer.decoding.llama_cpp_engine import LlamaCppEngine
    from citer.models.to_gguf import gguf_for

    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    eng = _engine(p, router, gguf_cache)
    torch_eng = RoutedEngine(p.slm, p.llm, router, 0.5, p.tok.eos_token_id, vocab_size=len(p.tok))
    for bad in (0, True, 1.5):
        for e in (eng, torch_eng):
            with pytest.raises(EngineInputError, match=r"max_rows must be an integer >= 1 or None"):
                e.session(max_rows=bad)
    files = (gguf_for(p.slm, "F32"), gguf_for(p.llm, "F32"))
    with pytest.raises(EngineInputError, match=r"embeds \d+ tokens, fewer than the tokenizer's"):
        LlamaCppEngine(*files, router, 0.5, vocab_size=max(eng.slm.vocab_size, eng.llm.vocab_size) + 1)
    for build in (LlamaCppEngine, RoutedEngine):
        models = files if build is LlamaCppEngine else (p.slm, p.llm)
        with pytest.raises(EngineInputError, match="vocab_size must be a positive integer"):
            build(*models, router, 0.5, vocab_size=0)


def test_teacher_forced_scores_are_the_torch_engines(answering_pair, gguf_cache, monkeypatch):
    import citer.decoding.llama_cpp_engine as lce
    from citer.decoding.scoring import routed_loglikelihood_batch

    p = answering_pair
    router = RandomRouter(0.4, seed=4)
    prompts = _prompts(p.tok, 5)
    items = [(q[: len(q) // 2], q[len(q) // 2 :]) for q in prompts]
    want = routed_loglikelihood_batch(RoutedEngine(p.slm, p.llm, router, 0.5, vocab_size=len(p.tok)), items,
                                      top_k=2)  # fmt: skip
    eng = _engine(p, router, gguf_cache)
    alone = eng.generate_batch([prompts[0]], 6, row_ids=[7]).tokens[0]
    sess = eng.session()  # a live session's rows stay as they are: scoring reads contexts of its own
    key = sess.add(prompts[0], 6, row_id=7)
    sess.step()
    monkeypatch.setattr(lce, "MAX_SEQUENCES", 2)  # five texts in three decodes
    got = routed_loglikelihood_batch(eng, items, top_k=2)
    for g, w in zip(got, want, strict=True):
        assert g.from_llm == w.from_llm
        assert g.is_greedy == w.is_greedy
        assert g.logprobs == pytest.approx(w.logprobs, abs=2e-3)
        assert [[t for t, _ in x] for x in g.top] == [[t for t, _ in x] for x in w.top]
    # any pairs, in any order, across chunks: what the torch engine's pass gives there
    rows, pos = [4, 0, 2, 0, 3, 1], [1, 2, 0, 0, 2, 1]
    for which in ("slm", "llm"):
        lg, hd = eng.positions(which, prompts, rows, pos)
        tl, th = RoutedEngine(p.slm, p.llm, router, 0.5, vocab_size=len(p.tok)).positions(
            which, prompts, rows, pos
        )
        # float32 both, summed in other orders: within 1e-2 (a position or text off by one differs by ~1)
        assert torch.allclose(lg, tl.detach(), atol=1e-2) and (hd is None) == (which == "llm")
        assert hd is None or torch.allclose(hd, th.detach(), atol=1e-2)
    flags = [f for w in want for f in w.from_llm]
    assert any(flags) and not all(flags)  # both models scored some tokens
    while sess.busy:
        sess.step()
    assert sess.stats(key).new_tokens == len(alone)  # (an answer may end before 6 tokens)


class _Recording:
    """The trained router, keeping each score it gives by (row, step): what the router reads while decoding."""

    def __init__(self, router):
        self.router, self.seen = router, {}

    def __call__(self, hidden, row_ids=None, steps=None):
        s = self.router(hidden).reshape(-1)
        for r, t, x in zip(row_ids.tolist(), steps.tolist(), s.tolist(), strict=True):
            self.seen[r, t] = x
        return s


def test_tau_and_the_oracle_come_from_the_runners_own_slm(answering_pair, gguf_cache):
    """The sweep's teacher-forced passes on a Q4_0 llama.cpp SLM: the scores τ is a quantile of are those the
    router reads while that SLM writes, and the oracle's flags replayed there return the LLM's answers exactly."""
    from citer.evaluation.oracle import OracleRouter, oracle_flags
    from citer.evaluation.plan import PassBench
    from citer.evaluation.thresholds import method_scores

    p = answering_pair
    prompts = _prompts(p.tok, 8)
    bench = PassBench(p.slm, p.llm, p.tok, "math", SweepParams(),
                      engine_params=EngineParams(runner="llama_cpp", llama_cpp_type="Q4_0"))  # fmt: skip
    scoring = bench.scoring_engine()
    rec = _Recording(p.router)
    answers = _engine(p, rec, gguf_cache, "Q4_0").generate_batch(prompts, 12).tokens  # τ 0.5: some routed
    n = [len(a) for a in answers]
    seen = np.array([rec.seen[i, t] for i in range(len(prompts)) for t in range(n[i])])
    # the positions where the SLM wrote (the routed ones were scored too, then written by the LLM)
    ours = method_scores(p.slm, {"citer": p.router}, prompts, answers, 3, p.tok.pad_token_id, scoring)[
        "citer"
    ]
    torch_scores = method_scores(p.slm, {"citer": p.router}, prompts, answers, 3, p.tok.pad_token_id)["citer"]
    assert len(ours) == len(seen) == sum(n)
    err, torch_err = np.abs(ours - seen).max(), np.abs(torch_scores - seen).max()
    assert err < 1e-3 and err < torch_err, (err, torch_err)  # torch's float32 SLM is not the one that decodes

    from citer.decoding.baselines import AlwaysSLM
    from citer.decoding.llama_cpp_engine import LlamaCppEngine
    from citer.models.to_gguf import gguf_for

    llm_only = LlamaCppEngine(gguf_for(p.llm, "Q4_0"), None, AlwaysSLM(), 1.0, p.tok.eos_token_id, len(p.tok))
    llm_answers = llm_only.generate_batch(prompts, 12).tokens
    flags = oracle_flags(p.slm, prompts, llm_answers, 3, p.tok.pad_token_id, len(p.tok), scoring)
    assert any(map(any, flags)) and not all(map(all, flags))
    replay = _engine(p, OracleRouter(flags), gguf_cache, "Q4_0").generate_batch(prompts, 12)
    assert replay.tokens == llm_answers  # torch's float32 flags may not: Q4_0's greedy token differs at some
    scoring.close()


def test_more_rows_than_llama_cpp_has_sequence_ids_take_turns(answering_pair, gguf_cache, monkeypatch):
    import citer.decoding.llama_cpp_runner as lcr

    p = answering_pair
    eng = _engine(p, RandomRouter(0.3, seed=4), gguf_cache)
    prompts = _prompts(p.tok)
    want = eng.generate_batch(prompts, 8).tokens
    monkeypatch.setattr(
        lcr, "MAX_SEQUENCES", 3
    )  # llama.cpp's own is 256: the sweep's 300 rows then take turns
    assert eng.generate_batch(prompts, 8).tokens == want and eng.slm.rows >= 3


def test_quantized_files_cost_less_and_keep_most_tokens(answering_pair, gguf_cache):
    p = answering_pair
    router = RandomRouter(0.3, seed=4)
    prompts = _prompts(p.tok, 8)
    full, q8 = _engine(p, router, gguf_cache), _engine(p, router, gguf_cache, "Q8_0")
    a, b = full.generate_batch(prompts, 10), q8.generate_batch(prompts, 10)
    assert q8.cost_llm.weight_bytes < 0.5 * full.cost_llm.weight_bytes
    same = sum(x == y for r, s in zip(a.tokens, b.tokens, strict=True) for x, y in zip(r, s, strict=False))
    assert same >= 0.9 * sum(map(len, a.tokens))
    assert sorted(f.name for f in gguf_cache.iterdir()) == sorted(
        {f.name for f in gguf_cache.iterdir() if f.name.endswith((".gguf",))}
    )  # no temporary file left behind


def test_engine_refuses_what_it_cannot_run(answering_pair, gguf_cache):
    p = answering_pair
    eng = _engine(p, RandomRouter(0.3), gguf_cache)
    with pytest.raises(EngineInputError, match=r"prompts\[0\]: token ids outside"):
        eng.generate_batch([[len(p.tok) + 5]], 4)
    with pytest.raises(EngineInputError, match="draft: 4 tokens leave nothing"):
        eng.generate_batch([[5, 6]], 4, drafts=[[7, 7, 7, 7]])
    with pytest.raises(EngineInputError, match="verify_window"):
        _engine(p, RandomRouter(0.3), gguf_cache, verify_rho=1.0, verify_window=-1)
    with pytest.raises(EngineInputError, match="max_new_tokens must be an integer"):
        eng.generate_batch([[5, 6]], 0)


def test_route_engine_builds_the_runner_the_params_name(answering_pair, gguf_cache):
    from citer.decoding.llama_cpp_engine import LlamaCppEngine
    from citer.serving.champion import route_engine

    p = answering_pair
    eng = route_engine(p.slm, p.llm, p.router, 0.4, EngineParams(runner="llama_cpp", llama_cpp_type="Q8_0"),
                       p.tok.eos_token_id)  # fmt: skip
    assert isinstance(eng, LlamaCppEngine) and eng.tau == 0.4
    assert len(list(gguf_cache.glob("*-q8_0.gguf"))) == 2  # both models converted once, then cached
    verified = route_engine(p.slm, p.llm, p.router, 0.4, EngineParams(runner="llama_cpp"), p.tok.eos_token_id,
                            verify_rho=1.0, verify_window=0, verify_final=True)  # fmt: skip
    assert (verified.verify.rho, verified.verify.final) == (1.0, True)


def _sweep(pair, engine: EngineParams):
    from citer.evaluation.sweep import run_sweep

    params = SweepParams(llm_fractions=[0.1, 0.3], batch_size=4, max_new_tokens=8, speculative=False)
    torch.manual_seed(0)
    return run_sweep(pair.slm, pair.llm, pair.tok, answering_rows(11, 12), answering_rows(12, 12), "math",
                     {"citer": pair.router}, params, engine=engine)  # fmt: skip


def _key(row):  # a threshold method's point by its target fraction: each runner takes τ from its own scores
    target = row.extra.get("target_llm_fraction")
    verify = tuple(row.extra.get(k) for k in ("verify_rho", "verify_window", "verify_final"))
    return row.method, target, row.tau if target is None else None, verify


@pytest.mark.slow
def test_the_sweep_decodes_every_pass_on_the_runner_the_params_name(answering_pair, gguf_cache):
    on_torch = _sweep(answering_pair, EngineParams())
    on_llama = _sweep(answering_pair, EngineParams(runner="llama_cpp", llama_cpp_type="F32"))
    for split in ("dev", "test"):
        want = {_key(r): r for r in getattr(on_torch, split)}
        got = {_key(r): r for r in getattr(on_llama, split)}
        assert set(got) == set(want), split  # every method, verified ones included, at the same points
        for k, r in got.items():
            w = want[k]
            facts, wanted = (
                (r.correct, r.llm_token_fraction, r.llm_calls),
                (w.correct, w.llm_token_fraction, w.llm_calls),
            )
            if k[0] in (
                "llm",
                "slm",
                "random",
            ):  # no threshold: decisions keyed on (row, step), tokens identical
                assert facts == wanted, k
            else:  # τ sits on a dev token's score (a quantile): llama.cpp's hidden states may flip that token
                assert abs(r.llm_token_fraction - w.llm_token_fraction) <= 0.05, k
        assert any(
            r.bytes_moved != want[k].bytes_moved for k, r in got.items()
        )  # llama.cpp's F16 KV, own bytes
    assert {k[0] for k in got} >= {"llm", "slm", "random", "citer", "confidence", "citer_verify", "bild"}
    assert on_llama.notes["verify"] == on_torch.notes["verify"]
    assert (
        on_llama.notes["teacher_forced_on"] == "llama_cpp F32" and "teacher_forced_on" not in on_torch.notes
    )
    # F32 both: τ from llama.cpp's scores, within float error of torch's
    for m, taus in on_llama.thresholds.items():
        assert [f for f, _ in taus] == [f for f, _ in on_torch.thresholds[m]], m
        assert [t for _, t in taus] == pytest.approx([t for _, t in on_torch.thresholds[m]], abs=1e-3), m
