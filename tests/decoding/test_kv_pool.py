"""The ragged KV cache: appends of mixed lengths, padded or packed, give the logits of an uncached forward."""

from __future__ import annotations

import pytest
import torch
from conftest import make_qwen2

from citer.decoding.kv_pool import KVPool
from citer.decoding.runner import ModelRunner

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40]]


@pytest.fixture(scope="module")
def llm():
    return make_qwen2(V, hidden_size=64, num_hidden_layers=2, seed=2)


@pytest.mark.parametrize("packed", [False, True])
def test_padding_never_changes_a_logit(llm, packed):
    seqs = [PROMPTS[2] + [30, 31, 32], PROMPTS[1] + [33], PROMPTS[0] + [34, 35, 36, 37]]
    ref = [llm(torch.tensor([s])).logits[0] for s in seqs]  # (T, V) each, no cache, no padding
    with torch.inference_mode():
        cache = KVPool(llm, 3, 32)
        # Prefill prompts of mixed length, then catch up rows 2 and 0 with different gaps in one call.
        lg, _ = ModelRunner(llm).feed(cache, [PROMPTS[2], PROMPTS[1], PROMPTS[0]], packed=packed)
        for i, p in enumerate([PROMPTS[2], PROMPTS[1], PROMPTS[0]]):
            torch.testing.assert_close(lg[i], ref[i][len(p) - 1], rtol=1e-4, atol=1e-4)
        lg, _ = ModelRunner(llm).feed(cache, [[34, 35, 36, 37], [30, 31, 32]], slots=[2, 0], packed=packed)
        torch.testing.assert_close(lg[0], ref[2][-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lg[1], ref[0][-1], rtol=1e-4, atol=1e-4)
        lg, _ = ModelRunner(llm).feed(cache, [[33]], slots=[1], packed=packed)
        torch.testing.assert_close(lg[0], ref[1][-1], rtol=1e-4, atol=1e-4)
        assert cache.lengths == [len(seqs[0]), len(seqs[1]), len(seqs[2])]


def test_a_large_models_catch_up_packs_at_little_padding_and_a_small_ones_pads(monkeypatch):
    """Pad tokens cost a layer's multiply-adds each; packing costs a fixed few ops a layer: a call packs where the pad
    tokens' work exceeds ``PACK_COST_MACS`` (or doubles the tokens), so the same 2-row catch-up (5 + 4 tokens: one
    pad) packs for a wide model and pads for a narrow one."""
    calls = []
    import citer.decoding.context as context

    real = context._packed
    monkeypatch.setattr(context, "_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    narrow = make_qwen2(V, hidden_size=64, num_hidden_layers=1, seed=3)
    wide = make_qwen2(V, hidden_size=512, intermediate_size=4096, num_hidden_layers=1, seed=3)
    for model, packs in ((narrow, False), (wide, True)):
        calls.clear()
        seqs = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
        with torch.inference_mode():
            cache = KVPool(model, 2, 16)
            lg, _ = ModelRunner(model).feed(cache, seqs)
            ref = [model(torch.tensor([s])).logits[0, -1] for s in seqs]
        assert bool(calls) is packs
        for i in range(2):
            torch.testing.assert_close(lg[i], ref[i], rtol=1e-4, atol=1e-4)


def test_slot_runs_cut_named_slots_into_views():
    from citer.decoding.context import slot_runs

    assert slot_runs([0, 1, 2]) == ((0, 0, 3),)
    assert slot_runs([1, 2, 4, 7, 8]) == ((0, 1, 2), (2, 4, 1), (3, 7, 2))
    assert slot_runs([3, 1]) == ((0, 3, 1), (1, 1, 1))  # out of order: runs of one


@pytest.mark.parametrize("packed", [False, True])
def test_named_slots_are_attended_in_place_with_the_gathers_logits(llm, monkeypatch, packed):
    """A catch-up over slots that are not the prefix (1, 2 and 4 of 5) reads each run of consecutive slots as a view of
    the pool: the pool never copies a row's keys (no index_select), and every logit equals the gathered call's."""
    seqs = [[5, 6, 7], [8, 9, 10, 11], [12], [13, 14, 15, 16, 17], [18, 19]]
    catch = [[20, 21], [22], [23, 24, 25]]
    import citer.decoding.runner as runner_mod

    real = runner_mod.prepare
    out = {}
    for in_place in (False, True):
        monkeypatch.setattr(
            runner_mod, "prepare", lambda *a, _r=real, _i=in_place, **k: _r(*a, **{**k, "in_place": _i})
        )
        gathers: list[int] = []
        real_select = torch.Tensor.index_select

        def counted(t, *a, _seen=gathers, _real=real_select):
            _seen.append(1)
            return _real(t, *a)

        with torch.inference_mode():
            pool = KVPool(llm, 5, 32)
            runner = ModelRunner(llm)
            runner.feed(pool, seqs)
            monkeypatch.setattr(torch.Tensor, "index_select", counted)
            out[in_place] = runner.feed(pool, catch, slots=[1, 2, 4], packed=packed, every=True)[0]
            monkeypatch.setattr(torch.Tensor, "index_select", real_select)
        assert bool(gathers) is not in_place
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)
