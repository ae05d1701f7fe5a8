"""Model loading, pair checking, the embedded tokenizer and the from-scratch pretraining of the embedded pair."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_qwen2
from transformers import AutoModelForCausalLM, AutoTokenizer

from citer.bootstrap import (
    BootstrapError,
    bootstrap_models,
    build_model,
    build_tokenizer,
    corpus_texts,
    encode_corpus,
    pretrain,
)
from citer.config import ArchParams, BootstrapParams, PretrainParams, SynthParams
from citer.data.synth import synthesize, write_splits
from citer.models import ModelLoadError, VocabMismatchError, count_params, load_model, load_pair

TINY_ARCH = ArchParams(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="module")
def synth_rows():
    return synthesize(SynthParams(seed=0, n_train=200, n_dev=20, n_test=20))


@pytest.fixture(scope="module")
def embedded_tok(synth_rows):
    return build_tokenizer(corpus_texts(synth_rows["math_train"], "math"), 512)


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


def test_embedded_tokenizer_round_trips_and_splits_digits(embedded_tok, synth_rows, tmp_path):
    tok = embedded_tok
    texts = corpus_texts(synth_rows["math_test"], "math") + ["any text: é 漢 \\boxed{12}\n\n  1234567890 ok"]
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t
    pieces = tok.convert_ids_to_tokens(tok.encode(" 1234 + 56 = 1290", add_special_tokens=False))
    digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert len(digits) == 10 and all(sum(ch.isdigit() for ch in p) == 1 for p in digits)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id not in (None, tok.eos_token_id)
    assert tok.encode("Question:", add_special_tokens=False)[-1] != tok.eos_token_id
    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again.get_vocab() == tok.get_vocab()
    assert again.decode(again.encode(texts[-1], add_special_tokens=False)) == texts[-1]
    with pytest.raises(BootstrapError, match="vocab_size"):
        build_tokenizer(texts, 100)


def test_pretraining_is_seeded_and_lowers_the_loss(embedded_tok, synth_rows):
    seqs = encode_corpus(corpus_texts(synth_rows["math_train"], "math"), embedded_tok, 512)
    assert all(s[-1] == embedded_tok.eos_token_id for s in seqs)
    pp = PretrainParams(steps=30, lr=1e-2, batch_size=8)
    runs = []
    for _ in range(2):
        model = build_model(TINY_ARCH, embedded_tok, seed=5)
        runs.append(pretrain(model, seqs, embedded_tok.pad_token_id, pp, seed=5, log_every=10))
    assert runs[0].losses == runs[1].losses
    assert runs[0].losses[-1] < 0.75 * runs[0].losses[0]
    with pytest.raises(BootstrapError, match="no training sequences"):
        pretrain(model, [], 0, pp, seed=0)


def test_bootstrap_writes_loadable_model_dirs(synth_rows, tmp_path):
    write_splits(tmp_path / "data", synth_rows)
    params = BootstrapParams(
        slm=TINY_ARCH,
        llm=TINY_ARCH.model_copy(update={"hidden_size": 32, "intermediate_size": 64}),
        slm_pretrain=PretrainParams(steps=3, lr=1e-3, batch_size=8),
        llm_pretrain=PretrainParams(steps=3, lr=1e-3, batch_size=8),
    )
    metrics = bootstrap_models(params, tmp_path / "data", tmp_path / "models")
    assert metrics["llm_params"] > metrics["slm_params"] > 0
    for name in ("slm_base", "llm"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / name)
        tok = AutoTokenizer.from_pretrained(tmp_path / "models" / name)
        assert model.config.model_type == "qwen2" and count_params(model) == metrics[f"{name[:3]}_params"]
        assert model.config.eos_token_id == tok.eos_token_id
    load_pair(tmp_path / "models" / "slm_base", tmp_path / "models" / "llm")
    # AutoTokenizer picks the class from the model's config (qwen2): it must tokenize exactly as training did.
    from citer.bootstrap import build_tokenizer

    texts = corpus_texts(synth_rows["math_train"], "math")
    trained = build_tokenizer(texts, params.vocab_size)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "models" / "llm")
    assert type(loaded).__name__ == type(trained).__name__
    assert all(
        loaded.encode(t, add_special_tokens=False) == trained.encode(t, add_special_tokens=False)
        for t in texts
    )
    assert (tmp_path / "models" / "tokenizer" / "tokenizer.json").is_file()
    # Same params, same weights.
    bootstrap_models(params, tmp_path / "data", tmp_path / "again")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "llm").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "again" / "llm").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bootstrap_without_data_fails_and_writes_nothing(tmp_path):
    with pytest.raises(BootstrapError, match="math_train.jsonl: training split not found"):
        bootstrap_models(BootstrapParams(), tmp_path / "nodata", tmp_path / "models")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "math_train.jsonl").write_text("")
    with pytest.raises(ValueError, match="math_train.jsonl"):
        bootstrap_models(BootstrapParams(), tmp_path / "empty", tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_count_params_counts_tied_embeddings_once(embedded_tok):
    tied = build_model(TINY_ARCH, embedded_tok, seed=0)
    untied = build_model(TINY_ARCH.model_copy(update={"tie_word_embeddings": False}), embedded_tok, seed=0)
    v, h = len(embedded_tok), TINY_ARCH.hidden_size
    assert count_params(untied) - count_params(tied) == v * h
    assert count_params(make_qwen2(v, hidden_size=16, num_hidden_layers=1)) > v * 16 * 2
