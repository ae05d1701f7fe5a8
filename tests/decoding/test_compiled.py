"""The compiled lean forward (citer.decoding.compiled) against the eager one, on tiny random models built here.

Each test compiles real Inductor graphs (C++ on this CPU), a few seconds per graph kind, hence the slow mark.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import spread_router
from test_lean import FAMILIES, PROMPTS, build

from citer.decoding.compiled import compiled_hidden
from citer.decoding.engine import RoutedEngine
from citer.decoding.kv_pool import KVPool
from citer.decoding.lean import lean_decoder
from citer.decoding.runner import ModelRunner

pytestmark = pytest.mark.slow


def _generate(slm, llm, prompts, n, forward="eager"):
    eng = RoutedEngine(slm, llm, spread_router(32), tau=0.5, forward=forward)
    res = eng.generate_batch(prompts, n)
    return res.tokens, res.from_llm, eng.forward_paths


def test_the_compiled_forward_routes_the_eager_tokens():
    """Decode steps, packed and padded catch-ups, rows of different lengths, a second batch size (the dynamic
    recompile): the same tokens and the same routing as the eager lean forward, and no fallback. The pair, router
    and prompts are the decided-step test's below, so the graphs it compiles are found in Inductor's cache there (a
    compile is seconds per graph on 2 cores); the logits test covers every family."""
    slm, llm = build("qwen2", seed=7, hidden=32, layers=1), build("qwen2", seed=8, hidden=64, layers=2)
    prompts = [*PROMPTS, [3, 4, 5, 6, 7, 8, 9, 10]]
    with torch.inference_mode():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="the lean forward cannot")  # a fallback: fail on it
            got = [_generate(slm, llm, p, 12, forward="compiled") for p in (prompts, prompts[:3])]
        assert len(compiled_hidden(lean_decoder(llm))._fns) >= 2  # step and catch-up graphs really ran
        assert compiled_hidden(lean_decoder(slm))._decide_fns  # the SLM's steps decided inside their graph
        # the engine's caches round their pools (5 and 3 rows -> 8 and 4), compiled for as static shapes
        assert {p[0] for p in compiled_hidden(lean_decoder(llm))._pools} == {8, 4}
        # Engines built after a compiled one over the same models run them as they were asked: eagerly.
        want = [_generate(slm, llm, p, 12) for p in (prompts, prompts[:3])]
    for (tok_w, llm_w, paths_w), (tok_g, llm_g, paths_g) in zip(want, got, strict=True):
        assert tok_g == tok_w
        assert llm_g == llm_w
        assert any(any(r) for r in llm_g)  # the LLM wrote tokens: catch-ups ran
        assert paths_w == {"slm": "lean", "llm": "lean"}
        assert paths_g == {"slm": "lean+compiled", "llm": "lean+compiled"}


def _eager_and_compiled(model, chunks):
    """Each call's logits (b, V) through the eager and the compiled lean forward, each over a pool of its own; a
    compile that falls back to eager fails the test."""
    outs = {}
    with torch.inference_mode():
        for path in ("eager", "compiled"):
            runner = ModelRunner(model, forward=path)
            pool = KVPool(model, len(chunks[0]), 64)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="the lean forward cannot")  # a fallback: fail on it
                outs[path] = [runner.feed(pool, c)[0] for c in chunks]
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_logits_match_the_eager_forward_over_a_ragged_cache(family):
    """A prefill, a ragged decode step with a mask and a packed catch-up: logits within float32 fusion rounding, for
    every family the lean forward covers (Qwen2.5: embeddings padded past the tokenizer and a tied head; Llama 3.x:
    its RoPE scaling; Qwen3: q/k norms)."""
    model = build(family, seed=3)
    chunks = [
        [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]],
        [[20], [21], [22]],
        [[30, 31, 32], [33], [34, 35, 36, 37]],
    ]
    outs = _eager_and_compiled(model, chunks)
    assert (
        len(compiled_hidden(lean_decoder(model))._fns) == 2
    )  # the step graph and the packed (varlen) one ran
    for eager, compiled in zip(outs["eager"], outs["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_a_bf16_forward_compiles_without_falling_back():
    """bf16 on a CPU takes citer's own linears eagerly (the kernel, oneDNN's packed weight); inside a graph they must
    leave nothing dynamo cannot trace (a check of torch.backends once made every bf16 compile fall back to eager).
    Catch-ups of 5-16 tokens are the packed weight's rows; the logits stay within bf16 rounding of the eager ones."""
    model = build("llama", seed=6).to(torch.bfloat16)
    chunks = [[[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]], [[20], [21]]]
    outs = _eager_and_compiled(model, chunks)
    assert compiled_hidden(lean_decoder(model))._fns
    for eager, compiled in zip(outs["eager"], outs["compiled"], strict=True):
        torch.testing.assert_close(compiled.float(), eager.float(), atol=0.1, rtol=0.05)


class _HostReadingCache(KVPool):
    """A cache whose buffers are checked on the host at every layer: no full graph can hold it."""

    def buffers(self, layer_idx, like):
        if float(like.sum()) != float(like.sum()):  # a host read (NaN check)
            raise ValueError("NaN input")
        return super().buffers(layer_idx, like)


def test_a_forward_that_cannot_compile_warns_once_and_runs_eagerly():
    model = build("qwen2", seed=4)
    chunks = [[5, 6, 7], [8, 9]]
    with torch.inference_mode():
        want = ModelRunner(model).feed(KVPool(model, 2, 32), chunks)[0]
        runner = ModelRunner(model, forward="compiled")
        assert runner.path == "lean+compiled"
        with pytest.warns(UserWarning, match="cannot be compiled"):
            got = runner.feed(_HostReadingCache(model, 2, 32), chunks)[0]
        assert runner.compiled is None  # later calls go straight to the eager forward
        assert runner.path == "lean"
    assert torch.equal(got, want)


def test_a_bad_forward_is_refused():
    with pytest.raises(ValueError, match="forward must be one of"):
        ModelRunner(build("qwen2", seed=5), forward="inductor")


def test_rounded_pools_take_few_shapes_and_only_a_few_compile_static():
    """A model with a compiled forward gets caches that round their pools (rows to a power of two, columns to 128); the compiled
    forward compiles static graphs for at most _STATIC_POOLS pool shapes, later ones stay symbolic."""
    from citer.decoding.compiled import _STATIC_POOLS, CompiledHidden

    model = build("qwen2", seed=6)
    cache = KVPool(model, 0, 0, round_shapes=True)
    cache.add_slots(3)
    cache.ensure_capacity(100)
    assert (cache._alloc, cache.capacity) == (4, 128)
    plain = KVPool(model, 0, 0)
    plain.add_slots(3)
    plain.ensure_capacity(100)
    assert (plain._alloc, plain.capacity) == (3, 100)
    assert ModelRunner(model, forward="compiled").new_pool().round_shapes  # a compiled runner's pools round
    assert not ModelRunner(model).new_pool().round_shapes
    ch = CompiledHidden(lean_decoder(model))
    pools = [torch.zeros(1 << i, 1, 4, 2) for i in range(_STATIC_POOLS + 1)]
    for p in pools:
        ch._mark_static(p)
    assert all(hasattr(p, "_dynamo_static_indices") for p in pools[:-1])
    assert not hasattr(pools[-1], "_dynamo_static_indices")
    ch._mark_static(again := torch.zeros(1, 1, 4, 2))  # a shape already compiled for is marked again
    assert hasattr(again, "_dynamo_static_indices")


class _ReadingRouter(torch.nn.Module):
    """A router that reads a value back to the host: no graph can hold it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if float(hidden.abs().sum()) < 0:  # never true: only the read matters
            raise ValueError("negative norm")
        return self.inner(hidden)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_compiled_step_decides_in_its_graph_as_the_eager_engine_does(temperature):
    """An MLP router (greedy and sampled rows): the decided compiled steps route the eager engine's tokens. A router
    that reads the host is tried once, warned about and decided eagerly, with the same tokens."""
    slm, llm = build("qwen2", seed=7, hidden=32, layers=1), build("qwen2", seed=8, hidden=64, layers=2)
    prompts = [*PROMPTS, [3, 4, 5, 6, 7, 8, 9, 10]]
    with torch.inference_mode():
        for router in (spread_router(32), _ReadingRouter(spread_router(32))):
            want = RoutedEngine(slm, llm, router, tau=0.5).generate_batch(
                prompts, 10, temperature=temperature
            )
            eng = RoutedEngine(slm, llm, router, tau=0.5, forward="compiled")
            reads = isinstance(router, _ReadingRouter)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = eng.generate_batch(prompts, 10, temperature=temperature)
            decided = eng.slm_runner.compiled
            assert (router in decided._untraceable) == reads
            assert any("decision cannot run inside its graph" in str(w.message) for w in caught) == reads
            assert not any("lean forward cannot" in str(w.message) for w in caught)
            assert got.tokens == want.tokens and got.from_llm == want.from_llm
            assert any(any(r) for r in got.from_llm) and not all(all(r) for r in got.from_llm)
