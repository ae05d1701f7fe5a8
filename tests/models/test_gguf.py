"""GGUF files as model sources (citer.models.gguf, citer.models.loading): tiny Qwen2 models written as GGUF here with
the ``gguf`` package (as llama.cpp's converter writes them), loaded back through load_model/load_tokenizer/load_pair,
and every kind of bad file refused in one line naming it. Seconds; the real bundled model is tests/models/
test_real_model.py."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import make_qwen2

from citer.models.gguf import bundled_smollm2, check_gguf, is_gguf, supported_tensor_types
from citer.models.loading import (
    ModelLoadError,
    VocabMismatchError,
    load_config,
    load_model,
    load_pair,
    load_tokenizer,
)


def _tokens(tok) -> list[str]:
    """The char tokenizer's vocabulary spelled as a byte-level BPE GGUF spells it (space as 'Ġ', newline 'Ċ'); its
    EOS named as Qwen2's, which transformers' Qwen2 tokenizer expects (it adds ``<|endoftext|>`` otherwise)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    out = []
    for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        special = t.startswith("<") and len(t) > 1
        out.append(t if special else "".join(spell[b] for b in t.encode()))
    out[tok.eos_token_id] = "<|endoftext|>"
    return out


def write_gguf(
    path: Path, model, tok, quant: str | None = None, arch: str = "qwen2", raw: dict[str, tuple] | None = None
) -> Path:
    """``model`` (a Qwen2ForCausalLM) and ``tok`` as a GGUF file: metadata, byte-level BPE vocabulary, tensors in
    F32 or, for 2-D weights, ``quant`` (e.g. ``"Q8_0"``). ``raw``: extra tensors {name: (bytes array, ggml type)}."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = _tokens(tok)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and len(t) > 1 else 1 for t in tokens])
    w.add_token_scores([0.0] * len(tokens))  # no merges in a character vocabulary: transformers derives none
    w.add_bos_token_id(tok.eos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, p in model.state_dict().items():
        data = p.detach().float().numpy()
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quant and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(target, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(target, data)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tok(char_tokenizer):
    return char_tokenizer  # the session's tokenizer, under the short name these tests use


@pytest.fixture(scope="module")
def tiny(tok):
    return make_qwen2(len(tok), hidden_size=32, num_hidden_layers=2, seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tok, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf", tiny, tok)


TEXT = "12 + 3 = 15\nso 15 - 4 = 11"


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


def test_is_gguf_by_suffix():
    assert is_gguf("models/x.gguf") and is_gguf(Path("/a/B.GGUF"))
    assert not is_gguf("models/slm") and not is_gguf("Qwen/Qwen2-0.5B")


def test_f32_gguf_loads_as_the_model_it_was_written_from(tiny, tok, tiny_gguf, tmp_path):
    model, gtok = load_model(tiny_gguf, "float32")
    ids = tok(TEXT)["input_ids"]
    assert gtok(TEXT)["input_ids"] == ids and gtok.decode(ids) == TEXT
    assert len(gtok) == len(tok) and gtok.eos_token_id == tok.eos_token_id
    assert torch.equal(_logits(model, ids), _logits(tiny, ids))  # F32 in, F32 out: the same model exactly
    # Dequantized it is an ordinary model: no GGUF marks, and it saves as a model directory that loads the same.
    assert (
        getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    )
    model.save_pretrained(tmp_path / "m")
    gtok.save_pretrained(tmp_path / "m")
    again, _ = load_model(tmp_path / "m", "float32")
    assert torch.equal(_logits(again, ids), _logits(tiny, ids))


def test_config_alone_reads_the_metadata(tiny, tiny_gguf):
    cfg = load_config(tiny_gguf)
    assert cfg.model_type == "qwen2" and cfg.hidden_size == 32 and cfg.num_hidden_layers == 2
    assert cfg.max_position_embeddings == tiny.config.max_position_embeddings and cfg.vocab_size == 99


def test_gguf_loads_in_the_requested_dtype(tiny_gguf):
    model, _ = load_model(tiny_gguf, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_q8_0_gguf_is_dequantized_close_to_its_source(tiny, tok, tmp_path):
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", tiny, tok, quant="Q8_0")
    assert check_gguf(path).tensor_types == ("F32", "Q8_0")
    model, _ = load_model(path, "float32")
    ids = tok(TEXT)["input_ids"]
    want, got = _logits(tiny, ids), _logits(model, ids)
    # 8-bit blocks of 32 with one scale each: about 0.4% error per weight, a few tenths of a percent in logits.
    assert not torch.equal(got, want)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_pair_of_gguf_files(tok, tmp_path):
    slm = write_gguf(
        tmp_path / "slm.gguf", make_qwen2(len(tok), hidden_size=32, num_hidden_layers=1, seed=1), tok
    )
    llm = write_gguf(
        tmp_path / "llm.gguf", make_qwen2(len(tok), hidden_size=64, num_hidden_layers=2, seed=2), tok
    )
    s, m, t = load_pair(slm, llm)
    assert s.config.hidden_size == 32 and m.config.hidden_size == 64 and len(t) == len(tok)


def test_gguf_and_directory_with_other_vocabularies_are_refused(tiny_gguf, tiny_pair_dirs):
    # The directory's character vocabulary spells a space " ", the GGUF's byte-level one "Ġ": different maps.
    with pytest.raises(VocabMismatchError, match=rf"SLM {tiny_gguf} and LLM .* different vocabularies"):
        load_pair(tiny_gguf, tiny_pair_dirs[1])


def _bad_files(root: Path, tiny, tok, good: Path) -> dict[str, tuple[Path, str]]:
    """{case: (path, the error it must give)}."""
    data = good.read_bytes()
    cases = {}
    cases["missing"] = (root / "absent.gguf", "GGUF file not found")
    (root / "dir.gguf").mkdir()
    cases["directory"] = (root / "dir.gguf", "not a file")
    (root / "text.gguf").write_text('{"not": "gguf"}')
    cases["not gguf"] = (root / "text.gguf", r"not a GGUF file \(starts with b'{\"no', not b'GGUF'\)")
    (root / "empty.gguf").write_bytes(b"")
    cases["empty"] = (root / "empty.gguf", r"not a GGUF file \(starts with b''")
    (root / "cut_header.gguf").write_bytes(data[:200])
    cases["cut in the header"] = (root / "cut_header.gguf", "truncated or corrupt GGUF file")
    (root / "cut_tensors.gguf").write_bytes(data[:-100])
    cases["cut in the tensors"] = (root / "cut_tensors.gguf", "truncated")
    arch = write_gguf(root / "rwkv.gguf", tiny, tok, arch="rwkv7")
    cases["architecture"] = (
        arch,
        r"GGUF architecture 'rwkv7' is not supported by transformers \S+, gguf \S+",
    )
    # Q8_1: a real llama.cpp type (an intermediate one) that no dequantizer here implements.
    q81 = (np.zeros((4, 40), dtype=np.uint8), "Q8_1")  # one block of 32 per row: 40 bytes
    quant = write_gguf(root / "q81.gguf", tiny, tok, raw={"blk.0.extra.weight": q81})
    cases["quant type"] = (
        quant,
        r"quantization type Q8_1 \(tensor blk.0.extra.weight\) cannot be dequantized",
    )
    return cases


@pytest.fixture(scope="module")
def bad_files(tiny, tok, tiny_gguf, tmp_path_factory):
    return _bad_files(tmp_path_factory.mktemp("bad"), tiny, tok, tiny_gguf)


CASES = [
    "missing",
    "directory",
    "not gguf",
    "empty",
    "cut in the header",
    "cut in the tensors",
    "architecture",
    "quant type",
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("loader", ["load_model", "load_tokenizer", "load_pair"])
def test_bad_gguf_is_refused_in_one_line_naming_it(bad_files, tiny_gguf, case, loader):
    path, why = bad_files[case]
    call = {
        "load_model": lambda: load_model(path),
        "load_tokenizer": lambda: load_tokenizer(path),
        "load_pair": lambda: load_pair(tiny_gguf, path),
    }[loader]
    with pytest.raises(ModelLoadError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert re.search(why, msg), msg


COMMON_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_supported_tensor_types_follow_the_readers():
    # llama and qwen2 go through the gguf package's dequantizer; the K-quants and the legacy 4/5/8-bit types are in.
    for arch in ("llama", "qwen2"):
        assert COMMON_TYPES <= supported_tensor_types(arch)
        assert "Q8_1" not in supported_tensor_types(arch)


def test_bundled_smollm2_is_a_gguf_file_or_none():
    path = bundled_smollm2()
    if path is not None:
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"


def test_a_gguf_sets_the_context_budget_and_is_fingerprinted_by_its_bytes(tiny, tiny_gguf, tmp_path):
    """The validate stage's row-length check and a label set's record of its pair read a .gguf as they read a
    directory: its context length and tokenizer, and a digest that changes when the file is replaced."""
    from citer.data.lengths import load_budget
    from citer.routing.iterations import model_fingerprint

    budget = load_budget([tiny_gguf])
    assert budget.limit == tiny.config.max_position_embeddings and budget.tokenizer is not None
    first = model_fingerprint(tiny_gguf)
    assert not first.startswith("hub:")
    copy = tmp_path / tiny_gguf.name
    copy.write_bytes(tiny_gguf.read_bytes()[:-8] + b"\0" * 8)
    assert model_fingerprint(copy) != first
