"""Routed decoding on llama.cpp: tiny Llama and Qwen2 models built here, written as GGUF files by citer's converter,
decoded by llama.cpp (``llama-cpp-python``, optional: ``CITER_LLAMA_CPP=1 bash scripts/setup.sh`` builds it; these
tests skip in one line without it).

The checks: llama.cpp reads the converted file as the model transformers runs (logits and the hidden state a router
reads); a routed run on llama.cpp writes the torch engine's tokens for the same router (the decision and sampler are
the engine's); rows in a batch write what they write alone; llama.cpp's own quantizer's files run the same path.
"""

from __future__ import annotations

import pytest
import torch

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter
from citer.decoding.engine import RoutedEngine
from citer.decoding.llama_cpp_runner import missing
from citer.decoding.rows import EngineInputError
from citer.models.gguf import GgufError

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))

VOCAB = 256
NEW = 12


def _model(family: str, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
              eos_token_id=None, bos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    m = (
        LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    ).eval()
    with torch.no_grad():
        for p in m.parameters():  # wide logits: clear top-1 margins, so float rounding never decides a token
            p.normal_(0.0, 0.15)
    return m


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    from citer.models.to_gguf import write_gguf

    d = tmp_path_factory.mktemp(f"gguf_{request.param}")
    slm, llm = _model(request.param, 64, 2, 1), _model(request.param, 128, 2, 2)
    return request.param, slm, llm, write_gguf(slm, d / "slm.gguf"), write_gguf(llm, d / "llm.gguf")


def _prompts(n: int, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (length + i,), generator=g).tolist() for i in range(n)]


def _runners(slm_path, llm_path, rows: int = 4):
    from citer.decoding.llama_cpp_runner import LlamaCppModel

    return LlamaCppModel(slm_path, rows, 64, hidden=True), LlamaCppModel(llm_path, rows, 64)


def test_llama_cpp_reads_the_converted_file_as_transformers_runs_it(pair):
    _, slm, _, slm_path, _ = pair
    ids = _prompts(1)[0]
    with torch.no_grad():
        out = slm(torch.tensor([ids]), output_hidden_states=True)
    s, llm_ctx = _runners(slm_path, slm_path)
    with s, llm_ctx:
        logits, hidden = s.feed({0: ids[:4]})
        logits, hidden = s.feed({0: ids[4:]})  # a second call continues the row's cache
    assert torch.allclose(logits[0], out.logits[0, -1], atol=2e-3)
    assert torch.allclose(hidden[0], out.hidden_states[-1][0, -1], atol=2e-3)  # the final norm's output


@pytest.mark.parametrize(
    "router", [AlwaysSLM(), AlwaysLLM(), RandomRouter(0.3, seed=0)], ids=lambda r: type(r).__name__
)
def test_routed_run_writes_the_torch_engines_tokens(pair, router):
    from citer.decoding.llama_cpp_engine import routed_generate

    _, slm, llm, slm_path, llm_path = pair
    prompts = _prompts(3)
    want = RoutedEngine(slm, llm, router, tau=0.5).generate_batch(prompts, NEW)
    s, lm = _runners(slm_path, llm_path)
    with s, lm:
        got = routed_generate(s, lm, prompts, router, 0.5, NEW)
    assert got.tokens == want.tokens
    assert got.from_llm == want.from_llm
    written = sum(map(sum, got.from_llm))
    if isinstance(router, AlwaysSLM):
        assert got.llm_calls == 0 and written == 0
    else:
        # one LLM call per step that routes any row; every token the LLM wrote came from one of them
        assert 0 < got.llm_calls <= NEW and written >= got.llm_calls


def test_rows_in_a_batch_write_what_they_write_alone_sampled_too(pair):
    from citer.decoding.llama_cpp_engine import routed_generate

    _, _, _, slm_path, llm_path = pair
    prompts = _prompts(3)
    router = RandomRouter(0.4, seed=3)
    s, lm = _runners(slm_path, llm_path)
    with s, lm:
        together = routed_generate(
            s, lm, prompts, router, 0.5, NEW, sampling=(1.0, 0.9, 5), row_ids=[10, 11, 12]
        )
        alone = [routed_generate(s, lm, [p], router, 0.5, NEW, sampling=(1.0, 0.9, 5), row_ids=[10 + i]).tokens[0]
                 for i, p in enumerate(prompts)]  # fmt: skip
    assert together.tokens == alone


def test_solo_decoding_is_the_routed_run_at_either_end(pair):
    from citer.decoding.llama_cpp_engine import routed_generate, solo_generate

    _, _, _, slm_path, llm_path = pair
    prompts = _prompts(3)
    s, lm = _runners(slm_path, llm_path, rows=2)  # 3 prompts through 2 rows: two chunks
    with s, lm:
        assert solo_generate(s, prompts, NEW) == routed_generate(s, lm, prompts, AlwaysSLM(), 0.5, NEW).tokens
        assert (
            solo_generate(lm, prompts, NEW) == routed_generate(s, lm, prompts, AlwaysLLM(), 0.5, NEW).tokens
        )


def test_a_row_ends_at_eos_and_the_others_go_on(pair):
    from citer.decoding.llama_cpp_engine import solo_generate

    _, _, _, slm_path, _ = pair
    prompts = _prompts(2)
    s, _ = _runners(slm_path, slm_path)
    with s:
        free = solo_generate(s, prompts, NEW)
        eos = free[0][3]
        cut = solo_generate(s, prompts, NEW, eos_ids=[eos])
    assert cut[0] == free[0][: free[0].index(eos) + 1]
    assert cut[1] == (free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1])


def test_llama_cpp_quantized_files_run_the_routed_path(pair, tmp_path):
    from citer.decoding.llama_cpp_engine import routed_generate
    from citer.decoding.llama_cpp_runner import gguf_type_counts
    from citer.models.to_gguf import quantize_gguf

    _, _, _, slm_path, llm_path = pair
    q_slm, q_llm = (
        quantize_gguf(slm_path, tmp_path / "s.gguf", "Q8_0"),
        quantize_gguf(llm_path, tmp_path / "l.gguf", "Q8_0"),
    )
    assert "Q8_0" in gguf_type_counts(q_llm) and q_llm.stat().st_size < llm_path.stat().st_size / 2
    prompts = _prompts(3)
    router = RandomRouter(0.3, seed=0)
    s, lm = _runners(slm_path, llm_path)
    qs, qlm = _runners(q_slm, q_llm)
    with s, lm, qs, qlm:
        full = routed_generate(s, lm, prompts, router, 0.5, NEW)
        q8 = routed_generate(qs, qlm, prompts, router, 0.5, NEW)
    same = sum(a == b for x, y in zip(full.tokens, q8.tokens, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.8 * len(prompts) * NEW, f"8-bit kept {same} of {len(prompts) * NEW} tokens"


def test_bad_inputs_fail_with_a_clear_message(pair, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from citer.decoding.llama_cpp_engine import routed_generate
    from citer.decoding.llama_cpp_runner import LlamaCppModel
    from citer.models.to_gguf import quantize_gguf, write_gguf

    _, _, _, slm_path, llm_path = pair
    with pytest.raises(GgufError, match="no such GGUF file"):
        LlamaCppModel(tmp_path / "absent.gguf", 1, 16)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(slm_path.read_bytes()[:4096])
    with pytest.raises(GgufError, match="truncated.gguf: llama.cpp could not load it"):
        LlamaCppModel(bad, 1, 16)
    with pytest.raises(GgufError, match="no GGUF writer for model_type 'gpt2'"):
        write_gguf(
            GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)), tmp_path / "g.gguf"
        )
    assert not (tmp_path / "g.gguf").exists() and not (tmp_path / "g.gguf.tmp").exists()
    with pytest.raises(GgufError, match="no quantization type 'Q3_Z'"):
        quantize_gguf(slm_path, tmp_path / "q.gguf", "Q3_Z")
    s, lm = _runners(slm_path, llm_path)
    with s, lm:
        with pytest.raises(
            EngineInputError,
            match=r"prompts\[0\]: 250 tokens is longer than the slm context allows \(max_position_embeddings 256 - "
            r"max_new_tokens 12 = 244\)",
        ):
            routed_generate(s, lm, [[5] * 250], AlwaysSLM(), 0.5, NEW)
        with pytest.raises(ValueError, match="must return hidden states"):
            routed_generate(lm, s, [[5] * 4], AlwaysSLM(), 0.5, NEW)
