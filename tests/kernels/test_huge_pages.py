"""The huge-page arena: views keep their values and sharing, and a model moved into it decodes the same tokens."""

from __future__ import annotations

import pytest
import torch

from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import RoutedEngine
from citer.decoding.lean import lean_decoder
from citer.kernels import huge_pages
from tests.decoding.test_lean import PROMPTS, V, build

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this kernel")


def test_arena_moves_each_storage_once_keeping_views_and_values():
    base = torch.randn(6, 40)
    rows, cols = base[2:5], base.t()[3]  # two views of one storage
    other = torch.randn(7, dtype=torch.bfloat16)
    sizes = huge_pages.cpu_storages([rows, cols, other])
    assert sizes is not None and list(sizes.values()) == [6 * 40 * 4, 7 * 2]  # base once, then other
    arena = huge_pages.Arena(sizes)
    new_rows, new_cols, new_other = arena(rows), arena(cols), arena(other)
    for old, new in ((rows, new_rows), (cols, new_cols), (other, new_other)):
        assert torch.equal(old, new) and new.stride() == old.stride() and new.dtype == old.dtype
    storages = {t.untyped_storage().data_ptr() for t in (new_rows, new_cols, new_other)}
    assert len(storages) == 1 and storages.isdisjoint({base.untyped_storage().data_ptr()})
    assert (new_rows.data_ptr() - rows.storage_offset() * 4) % huge_pages.PAGE == 0  # base's copy, first in
    assert (new_other.data_ptr() - other.storage_offset() * 2) % huge_pages.ALIGN == 0
    new_rows[0, 3] = 123.0  # the two views still share their element base[2, 3]
    assert new_cols[2] == 123.0 and base[2, 3] != 123.0
    assert arena(new_rows) is new_rows  # already in the arena
    with pytest.raises(KeyError):
        arena(torch.randn(3))  # a storage it was not sized for


def test_huge_pages_need_a_kernel_that_gives_them(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    assert not huge_pages.available()  # no such file: not Linux's THP
    mode.write_text("always madvise [never]\n")
    assert not huge_pages.available()
    mode.write_text("always [madvise] never\n")
    assert huge_pages.available()
    half = torch.empty(huge_pages.MIN_BYTES // 8)  # float32: half of MIN_BYTES
    assert not huge_pages.wanted(huge_pages.cpu_storages([half, half[:10]]))  # a storage counted once
    assert huge_pages.wanted(huge_pages.cpu_storages([half, torch.empty(huge_pages.MIN_BYTES // 8)]))
    assert not huge_pages.wanted(huge_pages.cpu_storages([]))
    assert huge_pages.cpu_storages([half, torch.empty(3, device="meta")]) is None  # one off the CPU
    assert not huge_pages.wanted(None)


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_small_models_keep_their_allocations():
    model = build("qwen2", seed=5)
    before = _storages(model)
    lean_decoder(model)
    assert len(before) > 1 and len(_storages(model)) > 1  # fused into new matrices, but no arena


@needs_thp
@pytest.mark.parametrize("family", ["qwen2", "qwen2.5"])  # untied head; tied (one storage for embed and head)
def test_a_model_moved_into_the_arena_decodes_the_same_tokens_and_saves(family, monkeypatch, tmp_path):
    slm, llm = build(family, seed=1, hidden=32, layers=1), build(family, seed=2, hidden=48, layers=2)
    twins = build(family, seed=1, hidden=32, layers=1), build(family, seed=2, hidden=48, layers=2)
    routed = {}
    for name, (s, m) in (("kept", twins), ("moved", (slm, llm))):
        if name == "moved":
            monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
        eng = RoutedEngine(s, m, RandomRouter(0.3, seed=0), vocab_size=V)
        routed[name] = eng.generate_batch(PROMPTS, 12, temperature=0.9, seed=3)
    assert routed["moved"].tokens == routed["kept"].tokens
    assert routed["moved"].from_llm == routed["kept"].from_llm
    for model in (slm, llm):
        assert len(_storages(model)) == 1  # every parameter in the one arena
        dec = lean_decoder(model)
        attn = model.model.layers[0].self_attn
        # HF's q/k/v still views of the fusion
        assert attn.q_proj.weight.data_ptr() == dec.layers[0].wqkv.data_ptr()
        assert attn.k_proj.weight.data_ptr() == dec.layers[0].wqkv[attn.q_proj.out_features :].data_ptr()
        assert dec.embed.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        assert dec.head.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():  # the HF modules read the moved weights too
        assert torch.equal(llm(ids).logits, twins[1](ids).logits)
    llm.save_pretrained(tmp_path)  # one storage under every parameter: each still saved as its own tensor
    reloaded = type(llm).from_pretrained(tmp_path).state_dict()
    assert reloaded.keys() == twins[1].state_dict().keys()
    assert all(torch.equal(t, reloaded[k]) for k, t in twins[1].state_dict().items())
