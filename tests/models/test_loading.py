"""Model loading (local directories, bad checkpoints, non-causal models) and pair checking."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TINY_ARCH, make_qwen2

from citer.models.bootstrap import (
    build_model,
)
from citer.models.loading import ModelLoadError, VocabMismatchError, count_params, load_model, load_pair


def test_load_model_from_local_dir(tiny_pair, tiny_pair_dirs):
    slm, _, tok = tiny_pair
    model, loaded_tok = load_model(tiny_pair_dirs[0])
    assert not model.training
    assert loaded_tok.get_vocab() == tok.get_vocab()
    ids = torch.tensor([tok.encode("1 + 2 =")])
    torch.testing.assert_close(model(ids).logits, slm(ids).logits)
    assert count_params(model) == sum(p.numel() for p in slm.parameters())


def test_missing_and_corrupt_checkpoints_are_named(tiny_pair_dirs, tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere.*not found"):
        load_model(tmp_path / "nowhere")
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_pair_dirs[0], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"truncated/model\.safetensors: corrupt or truncated"):
        load_model(bad)
    no_cfg = tmp_path / "nocfg"
    shutil.copytree(tiny_pair_dirs[0], no_cfg)
    (no_cfg / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(no_cfg)
    garbled = tmp_path / "garbled"
    shutil.copytree(tiny_pair_dirs[0], garbled)
    (garbled / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        load_model(garbled)


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path, char_tokenizer):
    from transformers import BertConfig, BertModel

    enc = BertModel(
        BertConfig(
            vocab_size=len(char_tokenizer),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    enc.save_pretrained(tmp_path / "bert")
    char_tokenizer.save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelLoadError, match=r"\['BertModel'\] is not a causal language model"):
        load_model(tmp_path / "bert")


def test_load_pair_refuses_different_vocabularies(tiny_pair_dirs, tmp_path, embedded_tok):
    slm_model, llm_model, tok = load_pair(*tiny_pair_dirs)
    assert count_params(llm_model) > count_params(slm_model)
    other = tmp_path / "other_llm"
    shutil.copytree(tiny_pair_dirs[1], other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    embedded_tok.save_pretrained(other)
    with pytest.raises(VocabMismatchError) as err:
        load_pair(tiny_pair_dirs[0], other)
    assert str(tiny_pair_dirs[0]) in str(err.value) and str(other) in str(err.value)


def test_count_params_counts_tied_embeddings_once(embedded_tok):
    tied = build_model(TINY_ARCH, embedded_tok, seed=0)
    untied = build_model(TINY_ARCH.model_copy(update={"tie_word_embeddings": False}), embedded_tok, seed=0)
    v, h = len(embedded_tok), TINY_ARCH.hidden_size
    assert count_params(untied) - count_params(tied) == v * h
    assert count_params(make_qwen2(v, hidden_size=16, num_hidden_layers=1)) > v * 16 * 2


def test_project_places_the_llm_by_its_device_map(tiny_pair_dirs, tmp_path):
    from citer.config import Params
    from citer.project import Project

    slm_dir, llm_dir = tiny_pair_dirs
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
            "lm_head": "cpu"}  # fmt: skip
    models = {"slm": str(slm_dir), "llm": str(llm_dir), "llm_device_map": dmap}
    _, llm, _ = Project(tmp_path, Params(models=models, finetune={"enabled": False})).load_pair()
    assert all(p.device.type == "cpu" for p in llm.parameters())
    # A device the machine lacks is refused in one line naming the LLM and the map entry, before loading weights.
    bad = {"": "cpu", "lm_head": "cuda:99"}
    with pytest.raises(
        ModelLoadError, match=rf"^{llm_dir}: device 'cuda:99' \(device_map entry 'lm_head'\)"
    ) as err:
        load_pair(slm_dir, llm_dir, llm_device_map=bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match=rf"^{slm_dir}: device 'gpu0' is not a torch device"):
        load_model(slm_dir, device="gpu0")
