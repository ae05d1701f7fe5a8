"""CUDA-graph steps (``static_steps="reduce-overhead"``): run wherever CUDA is present, skipped elsewhere (CI has none).

``python -m pytest -m gpu tests/decoding/test_gpu_steps.py`` on a GPU machine. The CPU proxy of the same property
(whole-graph trace, no host read, no recompile inside a bucket) is tests/decoding/test_static_step.py.
"""

from __future__ import annotations

import pytest
import torch

from citer.decoding.baselines import AlwaysSLM, RandomRouter
from citer.decoding.engine import RoutedEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

V = 512


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


@pytest.mark.parametrize("batch", [1, 8])
def test_graph_steps_match_eager_in_float32(batch):
    slm, llm = _model(64, 2, 1, torch.float32), _model(128, 3, 2, torch.float32)
    prompts = _prompts(batch, batch)
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0)).generate_batch(prompts, 48)
    got = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), static_steps="reduce-overhead").generate_batch(
        prompts, 48
    )
    assert got.tokens == ref.tokens and got.from_llm == ref.from_llm


def test_bf16_greedy_rows_mostly_equal_eager():
    """bf16: the graphs' kernels may round differently; >= 99% of 256-token rows equal (the issue's bar)."""
    slm, llm = _model(64, 2, 1, torch.bfloat16), _model(128, 3, 2, torch.bfloat16)
    prompts = _prompts(32, 3)
    ref = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0)).generate_batch(prompts, 256)
    got = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), static_steps="reduce-overhead").generate_batch(
        prompts, 256
    )
    same = sum(a == b for a, b in zip(got.tokens, ref.tokens, strict=True))
    assert same >= 0.99 * len(prompts) - 1e-9, f"{same} of {len(prompts)} rows equal"


def test_pool_growth_recaptures_and_keeps_tokens():
    """A session whose pool grows (more rows join, longer rows) re-captures and still gives eager's tokens."""
    slm = _model(64, 2, 1, torch.float32)
    eng = RoutedEngine(slm, None, AlwaysSLM(), static_steps="reduce-overhead")
    ref = RoutedEngine(slm, None, AlwaysSLM())
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


def test_the_steps_one_read_goes_through_a_pinned_buffer():
    """On CUDA the step's read copies into a page-locked buffer kept per shape, and returns what ``tolist`` would."""
    from citer.decoding.choice import _PINNED, read_to_host

    t = torch.tensor([[3, 1, 4], [1, 0, 1]], device="cuda")
    assert read_to_host(t) == t.tolist()
    buf = _PINNED[(t.device, (2, 3), torch.long)]
    assert buf.is_pinned()
    read_to_host(t + 1)
    assert _PINNED[(t.device, (2, 3), torch.long)] is buf and buf.tolist() == (t + 1).tolist()


@pytest.mark.parametrize("static_steps", [None, "eager", "reduce-overhead"])
def test_overlapped_steps_on_cuda_keep_every_token(static_steps):
    """``overlap=True`` on CUDA: the catch-up on a stream of its own (ragged and eager fixed-shape calls) or, under
    CUDA-graph trees, on the current stream before the SLM's step; either way the tokens of sequential steps."""
    from citer.decoding.catch_up import SideStream

    slm, llm = _model(64, 2, 1, torch.float32), _model(128, 3, 2, torch.float32)
    prompts = _prompts(8, 11)
    kw = dict(static_steps=static_steps, llm_min_rows=2, llm_max_wait_steps=2)
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), **kw)
    eng = RoutedEngine(slm, llm, RandomRouter(0.2, seed=0), overlap=True, **kw)
    side = SideStream.for_engine(eng)
    assert (side.stream is None) == (static_steps == "reduce-overhead")
    sess = eng.session()
    keys = [sess.add(p, 64, row_id=i) for i, p in enumerate(prompts)]
    out = {k: [] for k in keys}
    while sess.busy:
        for em in sess.step():
            out[em.key].append(em.token)
    assert sess.meter.overlapped > 0
    assert [out[k] for k in keys] == ref.generate_batch(prompts, 64).tokens
