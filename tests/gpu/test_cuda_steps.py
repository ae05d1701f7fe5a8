"""The engine on CUDA: captured fixed-shape steps (``forward="graphs"``) against the eager engine, run wherever CUDA
is present and skipped elsewhere (CI has none). Needs only torch and transformers, so it runs on a lent GPU machine:
``python -m pytest -c tests/gpu/pytest.ini --confcutdir tests/gpu tests/gpu`` (``bash bench/gpu_oneshot.sh`` does).
The CPU proxies of the same properties (one compile per model whatever the bucket, every input a static address, no
host read inside a step) are in tests/decoding/test_static_step.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # no project install on the GPU machine: the checkout is the package
    sys.path.insert(0, str(REPO))

from citer.decoding.baselines import AlwaysSLM, RandomRouter  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.decoding.lean import lean_decoder  # noqa: E402
from citer.decoding.static_step import step_stats  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

V = 512
# Where the counts the tests report go (bench/gpu_oneshot.sh sets it to its output directory).
RESULTS = os.environ.get("CITER_GPU_TESTS_OUT")


def _report(key: str, value: object) -> None:
    print(f"\nGPU-TEST {key}: {value}", flush=True)
    if RESULTS:
        path = Path(RESULTS) / "gpu_tests.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = value
        path.write_text(json.dumps(data, indent=1) + "\n")


def _model(hidden: int, layers: int, seed: int, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=V, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return m.to("cuda", dtype).eval()


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, V, (int(k),), generator=g).tolist() for k in torch.randint(8, 40, (n,), generator=g)
    ]


@pytest.fixture(scope="module")
def f32_pair():
    return _model(64, 2, 1, torch.float32), _model(128, 3, 2, torch.float32)


@pytest.mark.parametrize("batch", [1, 8])
def test_graph_steps_match_eager_in_float32(f32_pair, batch):
    slm, llm = f32_pair
    prompts = _prompts(batch, batch)
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0)).generate_batch(prompts, 48)
    eng = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), forward="graphs")
    got = eng.generate_batch(prompts, 48)
    again = eng.generate_batch(
        prompts, 48
    )  # replays the captures of the first call (the engine keeps its pools)
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm and again.tokens == ref.tokens
    stats = {w: step_stats(lean_decoder(m)).as_dict() for w, m in (("slm", slm), ("llm", llm))}
    equal = sum(a == b for a, b in zip(got.tokens, ref.tokens, strict=True))
    _report(f"float32_batch{batch}_equal_rows", f"{equal}/{batch}")
    _report(f"float32_batch{batch}_step_stats", stats)
    assert all(s["captures"] > 0 and s["compiles"] <= 3 for s in stats.values())


def test_bf16_agreement_is_reported():
    """bf16: the graphs' kernels may round differently from eager's; the share of equal rows is reported, not held to
    a bar (rounding alone flips some: eager fixed-shape against ragged steps agree on 19/32 rows on a CPU)."""
    slm, llm = _model(64, 2, 1, torch.bfloat16), _model(128, 3, 2, torch.bfloat16)
    prompts = _prompts(32, 3)
    ref = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0)).generate_batch(prompts, 128)
    got = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), forward="graphs").generate_batch(prompts, 128)
    same = sum(a == b for a, b in zip(got.tokens, ref.tokens, strict=True))
    pairs = zip(got.tokens, ref.tokens, strict=True)
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) for a, b in pairs]
    _report("bf16_equal_rows", f"{same}/{len(prompts)}")
    _report("bf16_mean_tokens_before_first_difference", sum(first) / len(first))
    assert all(len(t) == 128 for t in got.tokens)


def test_pool_growth_recaptures_and_keeps_tokens(f32_pair):
    """A session whose pool grows (more rows join, longer rows) re-captures and still gives eager's tokens."""
    slm = f32_pair[0]
    eng = RoutedEngine(slm, None, AlwaysSLM(), forward="graphs")
    ref = RoutedEngine(slm, None, AlwaysSLM())
    before = step_stats(lean_decoder(slm)).recaptures
    sess = eng.session()
    first = _prompts(2, 5)
    keys = [sess.add(p, 16) for p in first]
    out = {k: [] for k in keys}
    for _ in range(4):
        for em in sess.step():
            out[em.key].append(em.token)
    late = _prompts(6, 6)  # joins mid-flight: the slot pool doubles past its first size
    keys += [sess.add(p, 200) for p in late]  # and longer rows grow every slot's columns
    out |= {k: [] for k in keys[2:]}
    while sess.busy:
        for em in sess.step():
            out[em.key].append(em.token)
    want = ref.generate_batch(first, 16).tokens + ref.generate_batch(late, 200).tokens
    assert [out[k] for k in keys] == want
    assert step_stats(lean_decoder(slm)).recaptures > before


def test_captures_hold_no_second_copy_of_the_weights(f32_pair):
    """Every tensor a step reads is a static address, so a capture allocates only the step's intermediates: far less
    than the model's weights (a graph that copied its inputs would hold them twice). The LLM here is ~50 MB: the
    allocator reserves in 2 MiB segments, which outweighed the 2.9 MB LLM of ``f32_pair`` on the first GPU run."""
    slm = f32_pair[0]
    llm = _model(512, 4, 3, torch.float32)
    weights = sum(p.numel() * p.element_size() for p in llm.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    eng = RoutedEngine(slm, llm, RandomRouter(0.5, seed=1), forward="graphs")
    eng.generate_batch(_prompts(4, 9), 32)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    _report("capture_memory_over_llm_weights", round(grown / weights, 3))
    assert grown < weights


def test_the_steps_one_read_goes_through_a_pinned_buffer():
    """On CUDA the step's read copies into a page-locked buffer kept per shape, and returns what ``tolist`` would."""
    from citer.decoding.choice import _PINNED, read_to_host

    t = torch.tensor([[3, 1, 4], [1, 0, 1]], device="cuda")
    assert read_to_host(t) == t.tolist()
    buf = _PINNED[(t.device, (2, 3), torch.long)]
    assert buf.is_pinned()
    read_to_host(t + 1)
    assert _PINNED[(t.device, (2, 3), torch.long)] is buf and buf.tolist() == (t + 1).tolist()


@pytest.mark.parametrize("forward", ["eager", "graphs"])
def test_overlapped_steps_on_cuda_keep_every_token(f32_pair, forward):
    """``overlap=True`` on CUDA: eager steps put the catch-up on a stream of its own; captured steps stay in program
    order (the first GPU run saw two streams of graph replays part from the sequential tokens); the tokens of
    sequential steps either way. The report counts equal rows and the first differing step before asserting."""
    from citer.decoding.session import SideStream

    slm, llm = f32_pair
    prompts = _prompts(8, 11)
    kw = dict(forward=forward, llm_min_rows=2, llm_max_wait_steps=2)
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), **kw)
    eng = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), overlap=True, **kw)
    assert (SideStream.for_engine(eng).stream is None) == (forward == "graphs")
    sess = eng.session()
    keys = [sess.add(p, 64, row_id=i) for i, p in enumerate(prompts)]
    out = {k: [] for k in keys}
    while sess.busy:
        for em in sess.step():
            out[em.key].append(em.token)
    assert sess.meter.overlapped > 0
    got, want = [out[k] for k in keys], ref.generate_batch(prompts, 64).tokens
    firsts = [
        next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    _report(
        f"overlap_{forward}_equal_rows",
        f"{sum(f is None for f in firsts)}/{len(keys)}; first differences {firsts}",
    )
    assert got == want


def test_verified_routing_replays_its_every_position_graph(f32_pair):
    """Verified routing reads the LLM's logits at every caught-up position: a graph of its own per bucket."""
    slm, llm = f32_pair
    prompts = _prompts(4, 13)
    kw = dict(verify_rho=1.0, verify_final=True)
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), **kw).generate_batch(prompts, 32)
    got = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), forward="graphs", **kw).generate_batch(
        prompts, 32
    )
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm
