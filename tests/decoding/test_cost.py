"""The cost meter's formula, checked by hand on small cases."""

from __future__ import annotations

import pytest
from conftest import make_qwen2

from citer.decoding.cost import GPU_BANDWIDTH, CostMeter, ModelCost


def test_model_cost_from_config_and_dtype():
    m = make_qwen2(100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    c = ModelCost.from_model(m)
    n_all = sum(p.numel() for p in m.parameters())
    assert c.weight_bytes == (n_all - 100 * 32) * 4  # untied: the input table is only looked up
    assert c.kv_bytes_per_token == 2 * 2 * 2 * (32 // 4) * 4
    half = ModelCost.from_model(m.half())
    assert half.weight_bytes * 2 == c.weight_bytes and half.kv_bytes_per_token * 2 == c.kv_bytes_per_token


def test_tied_embeddings_counted_once():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    m = Qwen2ForCausalLM(cfg)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    n_unique = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    assert ModelCost.from_model(m).weight_bytes == n_unique * 4


def test_meter_formula_by_hand():
    slm, llm = ModelCost(1000, 10), ModelCost(100000, 50)
    m = CostMeter(slm, llm, n_rows=2, gpu="H200")
    m.forward("slm", [0, 1], [3, 5], [3, 5])  # prefill
    m.emitted([0, 1], [False, True])
    m.forward("llm", [1], [5], [5])
    m.llm_fed([1], [5], [0])
    m.forward("slm", [0, 1], [1, 1], [4, 6])
    rows, batch = m.finish(wall_seconds=2.0)
    r0_slm = 1000 / 2 + 10 * (3 + 3) + 1000 / 2 + 10 * (4 + 1)
    r1_slm = 1000 / 2 + 10 * (5 + 5) + 1000 / 2 + 10 * (6 + 1)
    r1_llm = 100000 + 50 * (5 + 5)
    assert rows[0].bytes_moved == pytest.approx(r0_slm)
    assert rows[1].slm_bytes == pytest.approx(r1_slm) and rows[1].llm_bytes == pytest.approx(r1_llm)
    assert batch.bytes_moved == pytest.approx(r0_slm + r1_slm + r1_llm)
    assert batch.slm_calls == 2 and batch.llm_calls == 1 and batch.new_tokens == 2 and batch.llm_tokens == 1
    assert batch.projected_seconds == pytest.approx(batch.bytes_moved / 4.8e12)
    assert batch.projected_seconds_per_token == pytest.approx(batch.projected_seconds / 2)
    assert rows[1].projected_seconds == pytest.approx((r1_slm + r1_llm) / GPU_BANDWIDTH["H200"])
    assert batch.wall_seconds_per_token == 1.0 and batch.llm_fraction == 0.5
    assert rows[1].llm_prompt_tokens == 5 and rows[1].llm_calls == 1 and rows[0].llm_calls == 0


def test_unknown_gpu():
    with pytest.raises(ValueError, match="unknown gpu"):
        CostMeter(ModelCost(1, 1), None, 1, gpu="A100")
