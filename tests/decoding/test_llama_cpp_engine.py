"""``engine.runner: llama_cpp`` through the pipeline: :class:`LlamaCppEngine` (the routed engine's batch interface on
llama.cpp) writes the torch engine's tokens with costs metered alike, ``route_engine`` builds it from the params, and
the sweep decodes every pass on it. Skips in one line without ``llama-cpp-python``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import answering_rows

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
    for toks, flags, st, prompt in zip(got.tokens, got.from_llm, got.rows, prompts, strict=True):
        assert st.new_tokens == len(toks) and st.llm_tokens == sum(flags)
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


def test_more_rows_than_llama_cpp_has_sequence_ids_take_turns(answering_pair, gguf_cache, monkeypatch):
    import citer.decoding.llama_cpp_engine as lce

    p = answering_pair
    eng = _engine(p, RandomRouter(0.3, seed=4), gguf_cache)
    prompts = _prompts(p.tok)
    want = eng.generate_batch(prompts, 8).tokens
    monkeypatch.setattr(
        lce, "MAX_SEQUENCES", 3
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
    with pytest.raises(EngineInputError, match="drafts"):
        eng.generate_batch([[5, 6]], 4, drafts=[[7]])
    with pytest.raises(EngineInputError, match="max_new_tokens must be an integer"):
        eng.generate_batch([[5, 6]], 0)


def test_params_choose_the_runner_and_refuse_torch_only_options():
    assert EngineParams().runner == "torch"
    assert EngineParams(runner="llama_cpp", llama_cpp_type="Q4_K_M").runner_name() == "llama_cpp:Q4_K_M"
    assert EngineParams(llama_cpp_type="Q4_0").runner_name() == "torch"  # the type matters only to llama_cpp
    with pytest.raises(ValueError, match="llama_cpp runs no llm_min_rows"):
        EngineParams(runner="llama_cpp", llm_min_rows=4)
    with pytest.raises(ValueError, match="llama_cpp_type"):
        EngineParams(runner="llama_cpp", llama_cpp_type="q4_0")


def test_route_engine_builds_the_runner_the_params_name(answering_pair, gguf_cache):
    from citer.decoding.llama_cpp_engine import LlamaCppEngine
    from citer.serving.champion import route_engine
    from citer.tracking.deployed import ChampionError

    p = answering_pair
    eng = route_engine(p.slm, p.llm, p.router, 0.4, EngineParams(runner="llama_cpp", llama_cpp_type="Q8_0"),
                       p.tok.eos_token_id)  # fmt: skip
    assert isinstance(eng, LlamaCppEngine) and eng.tau == 0.4
    assert len(list(gguf_cache.glob("*-q8_0.gguf"))) == 2  # both models converted once, then cached
    with pytest.raises(ChampionError, match="no verified routing"):
        route_engine(p.slm, p.llm, p.router, 0.4, EngineParams(runner="llama_cpp"), p.tok.eos_token_id,
                     verify_rho=1.0, verify_window=0, verify_final=True)  # fmt: skip


def _sweep(pair, engine: EngineParams):
    from citer.evaluation.sweep import run_sweep

    params = SweepParams(llm_fractions=[0.1, 0.3], batch_size=4, max_new_tokens=8, speculative=False)
    torch.manual_seed(0)
    return run_sweep(pair.slm, pair.llm, pair.tok, answering_rows(11, 12), answering_rows(12, 12), "math",
                     {"citer": pair.router}, params, engine=engine)  # fmt: skip


def _key(row):
    return row.method, row.tau, row.extra.get("target_llm_fraction")


@pytest.mark.slow
def test_the_sweep_decodes_every_pass_on_the_runner_the_params_name(answering_pair, gguf_cache):
    on_torch = _sweep(answering_pair, EngineParams())
    on_llama = _sweep(answering_pair, EngineParams(runner="llama_cpp", llama_cpp_type="F32"))
    verified = {"citer_verify", "bild"}
    for split in ("dev", "test"):
        want = {_key(r): r for r in getattr(on_torch, split) if r.method not in verified}
        got = {_key(r): r for r in getattr(on_llama, split)}
        assert set(got) == set(want), split  # every method but the verified ones, at the same dev-chosen taus
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
    assert {k[0] for k in got} >= {"llm", "slm", "random", "citer", "confidence"}
    assert on_llama.notes["verify"] == {"skipped": "engine.runner llama_cpp runs no verified routing"}
