"""Fixed-shape (graph-capturable) decode steps: same tokens as the ragged eager call, and whole-graph traceable."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_qwen2

from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.decoding.static_step import bucket
from citer.routing.mlp import MLPRouter

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
    got = RoutedEngine(slm, llm, RandomRouter(0.3, seed=0), forward="fixed").generate_batch(PROMPTS, 20, **kw)
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
    assert any(any(r) for r in got.from_llm)


def _mlp_router(hidden: int):
    torch.manual_seed(3)
    router = MLPRouter(hidden, 0.0)
    for m in router.net:
        if isinstance(m, torch.nn.BatchNorm1d):  # running stats that spread the scores around 0.5
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 2.0)
    return router.eval()


@pytest.mark.parametrize("router", ["random", "mlp"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_slm_step_decides_the_next_step_in_its_own_graph(pair, monkeypatch, router, temperature):
    """With fixed-shape steps, the router's score, the token choice and the hard flag run inside the SLM step's
    call (``static_decide``), so a step after the first does not route eagerly (the engine's ``route``, which the
    eager decision calls beside its token choice); the tokens and the routing are the ragged eager engine's. A step
    after a row was admitted decides eagerly for that step."""
    slm, llm = pair

    def make():
        return RandomRouter(0.3, seed=0) if router == "random" else _mlp_router(32)

    ref = RoutedEngine(slm, llm, make(), tau=0.5).generate_batch(PROMPTS, 16, temperature=temperature, seed=5)
    assert any(any(r) for r in ref.from_llm) and not all(all(r) for r in ref.from_llm)
    eager_calls: list[int] = []
    eng = RoutedEngine(slm, llm, make(), tau=0.5, forward="fixed")
    route = eng.route

    def spy(*a, **kw):
        eager_calls.append(1)
        return route(*a, **kw)

    monkeypatch.setattr(eng, "route", spy)
    got = eng.generate_batch(PROMPTS, 16, temperature=temperature, seed=5)
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
    assert len(eager_calls) == 1  # the first step only: its rows came from the prefill, not a decode step
    # Rows admitted over time (max_rows): each admission's step decides eagerly, the rest in the graph.
    monkeypatch.undo()
    ref = RoutedEngine(slm, llm, make(), tau=0.5).generate_batch(
        PROMPTS, 16, temperature=temperature, seed=5, max_rows=2
    )
    monkeypatch.setattr(eng, "route", spy)
    eager_calls.clear()
    got = eng.generate_batch(PROMPTS, 16, temperature=temperature, seed=5, max_rows=2)
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
    assert len(eager_calls) == 3  # 5 rows of equal budgets, 2 at a time: admitted at steps 1, 17 and 33


def test_rows_that_sample_differently_decide_eagerly_with_the_same_tokens(pair):
    slm, llm = pair
    engines = [RoutedEngine(slm, llm, RandomRouter(0.3, seed=0), forward=s) for s in ("eager", "fixed")]
    out = []
    for eng in engines:
        sess = eng.session()
        keys = [sess.add(p, 10, row_id=i, temperature=0.7 * (i % 2), seed=i) for i, p in enumerate(PROMPTS)]
        toks: dict[int, list[int]] = {k: [] for k in keys}
        while sess.busy:
            for em in sess.step():
                toks[em.key].append(em.token)
        assert sess._decided is None  # mixed sampling: no in-graph decision
        out.append([toks[k] for k in keys])
    assert out[0] == out[1]


def test_a_router_the_graph_cannot_hold_decides_eagerly_with_the_same_tokens(pair):
    """A router that reads values back to the host cannot run inside a traced step: the first traced call fails
    before running anything, warns, and the session decides eagerly from then on, with the same tokens."""

    class HostRouter:
        def __call__(self, hidden):
            # a Python-level decision: one host read per row
            return torch.tensor([0.2 if float(h.sum()) > 0 else 0.8 for h in hidden])

    slm, llm = pair
    ref = RoutedEngine(slm, llm, HostRouter(), tau=0.5).generate_batch(PROMPTS, 12)
    assert any(any(r) for r in ref.from_llm)
    eng = RoutedEngine(slm, llm, HostRouter(), tau=0.5, forward="aot_eager")
    with pytest.warns(UserWarning, match="cannot run inside the step's graph"):
        got = eng.generate_batch(PROMPTS, 12)
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
    assert eng.slm_runner.static._untraceable  # remembered: later steps do not trace it again


def test_unknown_forward_is_refused(pair):
    with pytest.raises(EngineInputError, match="forward"):
        RoutedEngine(*pair, RandomRouter(0.3), forward="reduce-overhead")


@pytest.mark.slow
@pytest.mark.parametrize("router", ["random", "mlp"])
def test_steps_trace_whole_and_compile_once_per_model_whatever_the_bucket(pair, monkeypatch, router):
    """The CPU proxy for CUDA-graph capture (the "graphs" mode with a checking backend): ``fullgraph=True`` fails on any
    graph break or host read (``.item()``, ``.tolist()``, a data-dependent shape); each model compiles its layer and
    its head once, and a second engine with other batch sizes, prompt lengths and tokens (other buckets) compiles
    nothing more. The step's decision is traced whole too: the router's score and the token choice."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from citer.decoding import runner as runner_mod
    from citer.decoding.lean import lean_decoder
    from citer.decoding.static_step import step_stats

    slm, llm = pair
    torch._dynamo.reset()
    counters.clear()
    host_reads: list[str] = []
    traced: list[set[str]] = []

    def checking_backend(gm, example_inputs):
        # A host read or a data-dependent shape inside the traced step would stall a CUDA graph.
        names = {str(getattr(node.target, "__name__", node.target)) for node in gm.graph.nodes}
        host_reads.extend(names & {"item", "tolist", "nonzero", "unique", "_local_scalar_dense"})
        traced.append(names)
        return gm.forward

    mode = runner_mod.FORWARDS["graphs"][1]
    monkeypatch.setitem(
        runner_mod.FORWARDS, "checked", ("lean", dataclasses.replace(mode, backend=checking_backend))
    )
    mlp = _mlp_router(32)

    def make(seed):
        return RandomRouter(0.3, seed=seed) if router == "random" else mlp

    def run(prompts, seed, max_rows):
        eng = RoutedEngine(slm, llm, make(seed), forward="checked")
        return eng.generate_batch(prompts, 12, max_rows=max_rows).tokens

    stats = [step_stats(lean_decoder(m)) for m in pair]
    before = [s.compiles for s in stats]
    ref = RoutedEngine(slm, llm, make(0)).generate_batch(PROMPTS[:4], 12, max_rows=4)
    assert run(PROMPTS[:4], 0, 4) == ref.tokens
    first = [s.compiles - b for s, b in zip(stats, before, strict=True)]
    assert first == [2, 2]  # per model: one layer and one head, for every bucket the run used
    assert len(stats[1].buckets) > 1
    other = [[t + 1 for t in p] + [7] * i for i, p in enumerate(PROMPTS)]
    ref = RoutedEngine(slm, llm, make(1)).generate_batch(other, 12, max_rows=3)
    assert run(other, 1, 3) == ref.tokens
    assert [s.compiles - b for s, b in zip(stats, before, strict=True)] == first  # no new forward graph
    assert not counters["graph_break"] and host_reads == []
    # The decision's graph ends in the choice (argmax) and the router (its sigmoid, or the random coin's hash).
    mark = "sigmoid" if router == "mlp" else "xor"
    assert any({"argmax", mark, "lt"} <= names for names in traced)


def test_a_session_steps_both_models_through_the_engines_fixed_shape_steps(pair, monkeypatch):
    """Each model's steps are the engine's own (built once per engine and model), not a copy or the eager call."""
    from citer.decoding import static_step

    used = []
    call = static_step.StaticSteps.__call__

    def spy(self, *args, **kwargs):
        used.append(self)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(static_step.StaticSteps, "__call__", spy)
    eng = RoutedEngine(*pair, RandomRouter(0.3, seed=0), forward="fixed")
    res = eng.generate_batch(PROMPTS, 8)
    assert any(any(r) for r in res.from_llm)
    steps = {"slm": eng.slm_runner.static, "llm": eng.llm_runner.static}
    assert all(s is not None for s in steps.values())
    assert {id(s) for s in used} == {id(s) for s in steps.values()}


def test_every_tensor_a_captured_step_reads_from_outside_is_a_static_address(pair, monkeypatch):
    """Under CUDA graphs an input that is not a static address is copied into the graph's own buffer at every replay
    (half a model's weights per step, for fused matrices that are plain tensors). Trace the "graphs" steps with a
    backend that records their inputs: every input whose memory existed before the step (weights, norms, RoPE
    tables, pools, the fixed input buffer) is marked static, and the list the steps expose covers every parameter."""
    from citer.decoding import runner as runner_mod
    from citer.decoding.lean import lean_decoder

    seen: list[torch.Tensor] = []

    def recording_backend(gm, example_inputs):
        seen.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    mode = dataclasses.replace(runner_mod.FORWARDS["graphs"][1], backend=recording_backend)
    monkeypatch.setitem(runner_mod.FORWARDS, "recorded", ("lean", mode))
    eng = RoutedEngine(*pair, RandomRouter(0.3, seed=0), forward="recorded")
    eng.generate_batch(PROMPTS, 8, max_rows=3)
    assert seen

    def ptr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    outside: set[int] = set()
    for m, runner in zip(pair, (eng.slm_runner, eng.llm_runner), strict=True):
        listed = {ptr(t) for t in lean_decoder(m).static_tensors()}
        assert {ptr(p) for p in m.parameters()} <= listed  # the exposed list misses no weight
        outside |= listed | {ptr(runner.static._in)}
    for cache in eng._pools:
        outside |= {ptr(t) for t in (*cache.keys, *cache.values)}
    from_outside = [t for t in seen if ptr(t) in outside]
    assert len(from_outside) > len(
        pair[1].model.layers[0].state_dict()
    )  # weights, pools and indices were inputs
    unmarked = [tuple(t.shape) for t in from_outside if getattr(t, "_dynamo_static_input_type", None) is None]
    assert unmarked == []
