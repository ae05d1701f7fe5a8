"""Baseline routers and the router interface."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_qwen2
from torch import nn

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, ConfidenceRouter, RandomRouter, wants_row_ids


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
