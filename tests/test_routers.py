"""Baseline routers and the counter-based noise."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_qwen2
from torch import nn

from citer.routers import (
    AlwaysLLM,
    AlwaysSLM,
    ConfidenceRouter,
    RandomRouter,
    counter_uniform,
    wants_row_ids,
)


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


def test_random_router_fraction_and_determinism():
    r = RandomRouter(0.3, seed=4)
    n = 5000
    h = torch.zeros(n, 8)
    s = r(h, row_ids=torch.arange(n), steps=torch.full((n,), 2))
    assert set(s.unique().tolist()) <= {0.0, 1.0}
    assert abs((s == 0).float().mean().item() - 0.3) < 0.03
    assert torch.equal(s, r(h, row_ids=torch.arange(n), steps=torch.full((n,), 2)))
    with pytest.raises(ValueError, match="row_ids"):
        r(h)
    with pytest.raises(ValueError, match="p must lie"):
        RandomRouter(1.2)


def test_constant_routers():
    h = torch.randn(4, 8)
    assert AlwaysSLM()(h).tolist() == [1.0] * 4
    assert AlwaysLLM()(h).tolist() == [0.0] * 4


def test_confidence_router_matches_slm_distribution():
    slm = make_qwen2(50, hidden_size=32, num_hidden_layers=1, seed=1)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        out = slm(ids, output_hidden_states=True)
        h = slm.model(ids).last_hidden_state[0]  # (T, H) after the final norm
    probs = out.logits[0].softmax(-1)  # (T, V)
    r = ConfidenceRouter.from_model(slm, "max_prob")
    torch.testing.assert_close(r(h), probs.max(-1).values)
    e = ConfidenceRouter.from_model(slm, "entropy")(h)
    ent = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(e, 1 - ent / math.log(50))
    flat = ConfidenceRouter(nn.Linear(4, 10, bias=False).requires_grad_(False), "entropy")
    nn.init.zeros_(flat.lm_head.weight)
    assert flat(torch.randn(2, 4)).abs().max().item() < 1e-6  # a uniform distribution has no confidence
    with pytest.raises(ValueError, match="kind"):
        ConfidenceRouter(slm.lm_head, "margin")


def test_wants_row_ids():
    class M(nn.Module):
        def forward(self, hidden):
            return hidden[:, 0]

    assert wants_row_ids(RandomRouter(0.1))
    assert not wants_row_ids(AlwaysSLM())
    assert not wants_row_ids(M())
    assert not wants_row_ids(ConfidenceRouter(nn.Linear(4, 4)))
    assert wants_row_ids(lambda hidden, row_ids, steps: hidden[:, 0])
