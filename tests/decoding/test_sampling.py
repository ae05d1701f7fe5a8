"""Counter-based noise and token choice: a row's draws depend on its keys, never on its batch."""

from __future__ import annotations

import pytest
import torch

from citer.decoding.sampling import STREAM_ROUTER, STREAM_SAMPLER, counter_uniform, select_tokens


def test_counter_uniform_depends_only_on_keys():
    rows = torch.tensor([3, 7, 11])
    steps = torch.tensor([0, 5, 5])
    u = counter_uniform(1, 1, rows, steps)
    assert u.shape == (3,) and bool(((u > 0) & (u < 1)).all())
    alone = counter_uniform(1, 1, rows[1:2], steps[1:2])
    assert alone[0] == u[1]  # batch layout does not matter
    assert counter_uniform(2, 1, rows, steps)[0] != u[0]  # the seed does
    assert counter_uniform(1, 2, rows, steps)[0] != u[0]  # so does the stream
    w = counter_uniform(1, 1, rows, steps, width=50)
    assert w.shape == (3, 50) and len(set(w[0].tolist())) == 50


def test_counter_uniform_is_roughly_uniform():
    n = 20000
    u = counter_uniform(0, 1, torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert (hist - n / 10).abs().max().item() < 0.05 * n / 10 * 3
    # Consecutive steps of one row are not correlated either.
    v = counter_uniform(0, 1, torch.zeros(n, dtype=torch.long), torch.arange(n))
    assert abs(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1].item()) < 0.03


def test_select_tokens_greedy_top_p_and_batch_invariance():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    rows, steps = torch.tensor([3, 8, 1, 5]), torch.tensor([0, 2, 2, 9])
    assert select_tokens(logits, 0.0, 1.0, 0, rows, steps).tolist() == logits.argmax(-1).tolist()
    # A top_p so small that only the most likely token survives is greedy whatever the noise.
    assert select_tokens(logits, 1.0, 1e-9, 7, rows, steps).tolist() == logits.argmax(-1).tolist()
    both = select_tokens(logits, 1.0, 1.0, 7, rows, steps)
    alone = [
        select_tokens(logits[i : i + 1], 1.0, 1.0, 7, rows[i : i + 1], steps[i : i + 1]) for i in range(4)
    ]
    assert both.tolist() == [int(a) for a in alone]
    # Many draws follow the softmax: the empirical frequency of each token tracks its probability.
    n = 4000
    one = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(n, 4)
    draws = select_tokens(one, 1.0, 1.0, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, torch.softmax(one[0].double(), -1), atol=0.03)
    assert STREAM_SAMPLER != STREAM_ROUTER  # sampling and routing never share draws


@pytest.mark.parametrize("n", [1, 7, 16, 17, 40])
def test_counter_uniform_python_int_and_numpy_paths_equal_the_tensor_path(n, monkeypatch):
    import citer.decoding.sampling as sampling

    g = torch.Generator().manual_seed(n)
    rows = torch.randint(0, 1 << 40, (n,), generator=g)
    steps = torch.randint(0, 1 << 20, (n,), generator=g)
    rows[0] = -3  # a negative id hashes by its low 32 bits on every path
    cpu = sampling.counter_uniform(
        11, sampling.STREAM_ROUTER, rows, steps
    )  # Python ints, or numpy past 16 rows
    monkeypatch.setattr(
        sampling.torch.compiler, "is_compiling", lambda: True
    )  # a traced step: tensor ops only
    tensor = sampling.counter_uniform(11, sampling.STREAM_ROUTER, rows, steps)
    assert cpu.dtype == tensor.dtype == torch.float64 and torch.equal(cpu, tensor)
