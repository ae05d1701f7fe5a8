"""The embedded pair: its tokenizer, seeded from-scratch pretraining, and the model directories bootstrap writes."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import TINY_ARCH, spawned_workers
from transformers import AutoModelForCausalLM, AutoTokenizer

from citer.config import BootstrapParams, PretrainParams
from citer.data.synth import write_splits
from citer.models.bootstrap import (
    BootstrapError,
    bootstrap_models,
    build_model,
    build_tokenizer,
    corpus_texts,
    encode_corpus,
    pretrain,
)
from citer.models.loading import count_params, load_pair


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
    metrics = bootstrap_models(
        params, tmp_path / "data", tmp_path / "models" / "slm_base", tmp_path / "models" / "llm"
    )
    assert metrics["llm_params"] > metrics["slm_params"] > 0
    # The two models side by side in worker processes: the same files as one after the other here.
    # What needs only the SLM runs once its directory is written, while the LLM still trains.
    seen = []

    def after_slm():
        seen.append([(tmp_path / "apart" / n / "config.json").is_file() for n in ("slm_base", "llm")])

    apart = bootstrap_models(
        params,
        tmp_path / "data",
        tmp_path / "apart" / "slm_base",
        tmp_path / "apart" / "llm",
        processes=2,
        after_slm=after_slm,
    )
    assert seen == [[True, False]]
    assert {k: v for k, v in apart.items() if "seconds" not in k} == {
        k: v for k, v in metrics.items() if "seconds" not in k
    }
    for name in ("slm_base", "llm"):
        here = sorted(p.relative_to(tmp_path / "models") for p in (tmp_path / "models" / name).rglob("*"))
        assert here == sorted(
            p.relative_to(tmp_path / "apart") for p in (tmp_path / "apart" / name).rglob("*")
        )
        for rel in here:
            if (tmp_path / "models" / rel).is_file():
                assert (tmp_path / "models" / rel).read_bytes() == (tmp_path / "apart" / rel).read_bytes(), (
                    rel
                )
    for name in ("slm_base", "llm"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / name)
        tok = AutoTokenizer.from_pretrained(tmp_path / "models" / name)
        assert model.config.model_type == "qwen2" and count_params(model) == metrics[f"{name[:3]}_params"]
        assert model.config.eos_token_id == tok.eos_token_id
    load_pair(tmp_path / "models" / "slm_base", tmp_path / "models" / "llm")
    # AutoTokenizer picks the class from the model's config (qwen2): it must tokenize exactly as training did.
    from citer.models.bootstrap import build_tokenizer

    texts = corpus_texts(synth_rows["math_train"], "math")
    trained = build_tokenizer(texts, params.vocab_size)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "models" / "llm")
    assert type(loaded).__name__ == type(trained).__name__
    assert all(
        loaded.encode(t, add_special_tokens=False) == trained.encode(t, add_special_tokens=False)
        for t in texts
    )
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["llm", "slm_base"]  # where params say
    # Same params, same weights.
    bootstrap_models(params, tmp_path / "data", tmp_path / "again" / "slm", tmp_path / "again" / "llm")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "llm").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "again" / "llm").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bootstrap_without_data_fails_and_writes_nothing(tmp_path):
    with pytest.raises(BootstrapError, match="math_train.jsonl: training split not found"):
        bootstrap_models(BootstrapParams(), tmp_path / "nodata", tmp_path / "models/s", tmp_path / "models/l")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "math_train.jsonl").write_text("")
    with pytest.raises(ValueError, match="math_train.jsonl"):
        bootstrap_models(BootstrapParams(), tmp_path / "empty", tmp_path / "models/s", tmp_path / "models/l")
    assert not (tmp_path / "models").exists()


def test_a_failure_beside_the_llm_stops_its_worker_and_writes_no_llm(synth_rows, tmp_path):
    write_splits(tmp_path / "data", synth_rows)
    slow = PretrainParams(steps=100_000, lr=1e-3, batch_size=8)  # would run for many minutes
    params = BootstrapParams(
        slm=TINY_ARCH,
        llm=TINY_ARCH,
        slm_pretrain=PretrainParams(steps=2, lr=1e-3, batch_size=8),
        llm_pretrain=slow,
    )

    def fail():
        raise RuntimeError("finetune failed")

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="finetune failed"):
        bootstrap_models(
            params, tmp_path / "data", tmp_path / "m" / "slm_base", tmp_path / "m" / "llm", 2, after_slm=fail
        )
    assert time.monotonic() - t0 < 60
    assert spawned_workers() == []  # the LLM's worker was stopped, not left training
    assert (tmp_path / "m" / "slm_base").is_dir() and sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "slm_base"
    ]
