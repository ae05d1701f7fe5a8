"""Speculative decoding (assisted generation): lossless against the LLM's greedy output, every call metered."""

from __future__ import annotations

import torch

from citer.data.answers import grade
from citer.decoding.cost import ModelCost
from citer.decoding.speculative import speculative_generate
from citer.evaluation.passes import speculative_result

PROMPTS = ["Question: 1+2\nAnswer:", "Question: 7\nAnswer:"]


def test_output_is_the_llms_and_calls_are_metered(tiny_pair):
    slm, llm, tok = tiny_pair
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    eos, hooks = tok.eos_token_id, (len(slm._forward_pre_hooks), len(llm._forward_pre_hooks))
    cfg = slm.generation_config
    outs = speculative_generate(
        slm, llm, ids, max_new_tokens=12, draft_tokens=3, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    w_slm, w_llm = ModelCost.from_model(slm).weight_bytes, ModelCost.from_model(llm).weight_bytes
    for p, o in zip(ids, outs, strict=True):
        ref = llm.generate(
            torch.tensor([p]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert o.tokens == ref  # greedy assisted generation is lossless
        assert 1 <= o.llm_calls <= len(o.tokens) and o.slm_calls >= 1
        assert o.weight_bytes == o.slm_calls * w_slm + o.llm_calls * w_llm
        assert o.bytes_moved > o.weight_bytes and o.wall_seconds > 0
    # Hooks and the draft schedule are the models' own again afterwards.
    assert (
        len(slm._forward_pre_hooks),
        len(llm._forward_pre_hooks),
    ) == hooks and slm.generation_config is cfg


def test_speculative_result_shares_weight_reads(tiny_pair):
    slm, llm, tok = tiny_pair
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    outs = speculative_generate(
        slm, llm, ids, max_new_tokens=8, draft_tokens=2, eos_token_id=tok.eos_token_id, pad_token_id=0
    )
    rows = [{"problem": "1+2", "solution": "\\boxed{3}"}, {"problem": "7", "solution": "\\boxed{7}"}]
    alone, totals = speculative_result(outs, tok, rows, "math", "H100", weight_share=1)
    shared, _ = speculative_result(outs, tok, rows, "math", "H100", weight_share=4)
    # bytes_moved is always the batch-1 price; the batch-shared estimate is its own column.
    assert alone.bytes_moved == shared.bytes_moved == [o.bytes_moved for o in outs]
    assert alone.batch_bytes == alone.bytes_moved
    for a, s, o in zip(alone.bytes_moved, shared.batch_bytes, outs, strict=True):
        assert abs((a - s) - 0.75 * o.weight_bytes) < 1e-6 * a
    assert totals["new_tokens"] == sum(alone.n_tokens) and alone.tokens == [o.tokens for o in outs]
    texts = [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
    assert alone.correct == [grade(t, r, "math") for t, r in zip(texts, rows, strict=True)]
