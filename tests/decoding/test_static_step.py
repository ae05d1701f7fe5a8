"""Fixed-shape (graph-capturable) decode steps: same tokens as the ragged eager call, and whole-graph traceable."""

from __future__ import annotations

import pytest
from conftest import make_qwen2

from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.decoding.static_step import bucket

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40], [41, 42, 43]]


@pytest.fixture(scope="module")
def pair():
    return make_qwen2(V, hidden_size=32, num_hidden_layers=1, seed=1), make_qwen2(
        V, num_hidden_layers=2, seed=2
    )


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]


@pytest.mark.parametrize("max_rows", [1, 3, 5])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fixed_shape_steps_give_the_ragged_calls_tokens(pair, max_rows, temperature):
    """Pad rows (3 rows run as a bucket of 4), pad tokens (catch-ups of 3 run as 4) and attention over the whole
    pool change no token; rows join as others finish."""
    slm, llm = pair
    kw = dict(max_rows=max_rows, temperature=temperature, seed=5)
    ref = RoutedEngine(slm, llm, RandomRouter(0.3, seed=0)).generate_batch(PROMPTS, 20, **kw)
    got = RoutedEngine(slm, llm, RandomRouter(0.3, seed=0), static_steps="eager").generate_batch(
        PROMPTS, 20, **kw
    )
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
    assert any(any(r) for r in got.from_llm)


def test_unknown_static_steps_mode_is_refused(pair):
    with pytest.raises(EngineInputError, match="static_steps"):
        RoutedEngine(*pair, RandomRouter(0.3), static_steps="graphs")


@pytest.mark.slow
def test_steps_trace_whole_and_never_recompile_inside_a_bucket(pair, monkeypatch):
    """The CPU proxy for CUDA-graph capture: ``fullgraph=True`` fails on any graph break or host read (``.item()``,
    ``.tolist()``, a data-dependent shape), and a second session with other tokens in the same buckets adds no
    graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from citer.decoding import engine as engine_mod

    slm, llm = pair
    torch._dynamo.reset()
    counters.clear()
    host_reads: list[str] = []

    def checking_backend(gm, example_inputs):
        # A host read or a data-dependent shape inside the traced step would stall a CUDA graph.
        for node in gm.graph.nodes:
            name = str(getattr(node.target, "__name__", node.target))
            if name in ("item", "tolist", "nonzero", "unique", "_local_scalar_dense"):
                host_reads.append(name)
        return gm.forward

    monkeypatch.setitem(engine_mod.STATIC_STEPS, "checked", {"backend": checking_backend})

    def run(prompts, seed):
        eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=seed), static_steps="checked")
        sess = eng.session(max_rows=4)
        sess.reserve(48)  # one pool size: K is part of a bucket
        keys = [sess.add(p, 12) for p in prompts]
        out = {k: [] for k in keys}
        while sess.busy:
            for em in sess.step():
                out[em.key].append(em.token)
        return [out[k] for k in keys]

    ref = RoutedEngine(slm, llm, RandomRouter(0.3, seed=0)).generate_batch(PROMPTS[:4], 12)
    assert run(PROMPTS[:4], 0) == ref.tokens
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    # Every step already moved positions and lengths inside its buckets; other tokens of the same lengths replay the
    # same buckets.
    run([[t + 1 for t in p] for p in PROMPTS[:4]], 0)
    assert counters["stats"]["unique_graphs"] == graphs  # same buckets: no new graph
    assert not counters["graph_break"] and host_reads == []


def test_a_session_steps_both_models_through_the_engines_fixed_shape_steps(pair, monkeypatch):
    """Each model's steps are the engine's own (built once per engine and model), not a copy or the eager call."""
    from citer.decoding import static_step

    used = []
    call = static_step.StaticSteps.__call__

    def spy(self, *args, **kwargs):
        used.append(self)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(static_step.StaticSteps, "__call__", spy)
    eng = RoutedEngine(*pair, RandomRouter(0.3, seed=0), static_steps="eager")
    res = eng.generate_batch(PROMPTS, 8)
    assert any(any(r) for r in res.from_llm)
    steps = {"slm": eng.static_for("slm"), "llm": eng.static_for("llm")}
    assert all(s is not None for s in steps.values())
    assert {id(s) for s in used} == {id(s) for s in steps.values()}
