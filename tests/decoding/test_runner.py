"""ModelRunner.forward: the logits of the model and the hidden state the router reads."""

from __future__ import annotations

import torch
from conftest import make_qwen2

from citer.decoding.runner import ModelRunner

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40]]


def test_the_runners_forward_matches_model_logits():
    slm = make_qwen2(V, hidden_size=32, num_hidden_layers=1, seed=1)
    ids = torch.tensor([PROMPTS[2]])
    logits, hidden = ModelRunner(slm).forward(ids)
    torch.testing.assert_close(logits, slm(ids).logits)
    assert hidden.shape == (1, ids.shape[1], 32)
    last, h_last = ModelRunner(slm).forward(ids, last_index=torch.tensor([4]))
    torch.testing.assert_close(last[0], logits[0, 4])
    torch.testing.assert_close(h_last[0], hidden[0, 4])
