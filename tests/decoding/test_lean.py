"""The lean forward (citer.decoding.lean) against the HF modules, on tiny random models of each family built here."""

from __future__ import annotations

import pytest
import torch

from citer.decoding.baselines import AlwaysLLM, RandomRouter
from citer.decoding.engine import RoutedEngine
from citer.decoding.kv_pool import KVPool
from citer.decoding.lean import lean_decoder
from citer.decoding.runner import ModelRunner

V = 97  # the tokenizer's ids; "qwen2.5" pads its embeddings beyond them
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40]]


def build(family: str, seed: int, hidden: int = 32, layers: int = 2):
    import transformers as tf

    common = dict(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    if family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "qwen2.5":  # embeddings padded past the tokenizer, tied head
        cfg = tf.Qwen2Config(**{**common, "vocab_size": 128, "tie_word_embeddings": True})
    elif family == "llama":  # Llama 3.x: no q/k/v bias, llama3 RoPE scaling
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)  # fmt: skip
        cfg = tf.LlamaConfig(**common, rope_parameters=rope)
    elif family == "qwen3":  # q/k norms, head_dim not hidden / heads
        cfg = tf.Qwen3Config(**common, head_dim=16)
    else:
        raise ValueError(family)
    model_cls = {"qwen2": tf.Qwen2ForCausalLM, "qwen2.5": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM,
                 "qwen3": tf.Qwen3ForCausalLM}[family]  # fmt: skip
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # well-separated argmax decisions (fewer ties) than the default init
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        for n, p in model.named_parameters():
            if "norm" in n:  # norms away from 1, so a norm applied wrongly shows
                p.uniform_(0.5, 1.5)
    return model.eval()


FAMILIES = ("qwen2", "qwen2.5", "llama", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    fam = request.param
    return fam, build(fam, seed=1, hidden=32, layers=1), build(fam, seed=2, hidden=48, layers=2)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():  # the HF modules' own forward: the oracle
        return model(torch.tensor([ids])).logits[0]  # (T, V)


def test_full_forward_logits_equal_hf(pair):
    _, _, llm = pair
    ids = PROMPTS[2]
    with torch.no_grad():
        logits, hidden = ModelRunner(llm).forward(torch.tensor([ids]))
    assert ModelRunner(llm).path == "lean"
    torch.testing.assert_close(logits[0], hf_logits(llm, ids), atol=1e-5, rtol=1e-5)
    assert hidden.shape == (1, len(ids), llm.config.hidden_size)


def test_ragged_cache_steps_equal_hf_at_every_position(pair):
    """Rows of different lengths prefilled together, then fed token by token (with a held row and a catch-up):
    each returned logit row equals HF's full forward at that position."""
    _, _, llm = pair
    seqs = [list(p) for p in PROMPTS]
    cache = KVPool(llm, len(seqs), 40)
    with torch.inference_mode():
        logits, _ = ModelRunner(llm).feed(cache, seqs)
        got = {i: [logits[i]] for i in range(len(seqs))}
        for step in range(6):
            # Row 1 is held every other step; row 3 catches up on three tokens at step 2.
            chunks = [[20 + step + r] for r in range(len(seqs))]
            if step % 2:
                chunks[1] = []
            if step == 2:
                chunks[3] = [30, 31, 32]
            logits, _ = ModelRunner(llm).feed(cache, chunks)
            for r, c in enumerate(chunks):
                if c:
                    seqs[r] += c
                    got[r].append(logits[r])
    for r, s in enumerate(seqs):
        ref = hf_logits(llm, s)
        # Positions whose logits were returned: after the prompt, then after each fed chunk.
        ends, n = [len(PROMPTS[r]) - 1], len(PROMPTS[r])
        for step in range(6):
            fed = 0 if (r == 1 and step % 2) else (3 if (r == 3 and step == 2) else 1)
            if fed:
                n += fed
                ends.append(n - 1)
        torch.testing.assert_close(torch.stack(got[r]), ref[ends], atol=1e-5, rtol=1e-5)


def test_packed_catch_up_attends_per_row_and_equals_hf(pair, monkeypatch):
    """A packed catch-up (rows with different gaps in one sequence) through the lean forward: logits at every fed
    position equal HF's full forward, and each attention call scores a row's queries against that row's columns only
    ((b, 1, Q, K) masks), never against every row's keys."""
    import citer.decoding.lean as lean_mod

    _, _, llm = pair
    seqs = [list(p) for p in PROMPTS]
    masks: list[tuple[int, ...]] = []
    sdpa = lean_mod.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(tuple(attn_mask.shape) if attn_mask is not None else ())
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    cache = KVPool(llm, len(seqs), 40)
    gaps = [[50, 51, 52, 53, 54, 55], [56], [57, 58], [59, 60, 61, 62, 63]]
    with torch.inference_mode():
        ModelRunner(llm).feed(cache, seqs)
        monkeypatch.setattr(lean_mod.F, "scaled_dot_product_attention", spy)
        logits, _ = ModelRunner(llm).feed(
            cache, gaps, slots=[0, 1, 2, 3], packed=True, every=True
        )  # (b, Q, V)
        monkeypatch.undo()
    width = max(len(p) + len(g) for p, g in zip(PROMPTS, gaps, strict=True))
    assert masks and all(m == (4, 1, 6, width) for m in masks)
    for r, g in enumerate(gaps):
        ref = hf_logits(llm, seqs[r] + g)[len(seqs[r]) :]  # (gap, V)
        torch.testing.assert_close(logits[r, : len(g)], ref, atol=1e-5, rtol=1e-5)


def test_a_step_where_every_row_is_at_the_last_column_attends_without_a_mask(pair, monkeypatch):
    """Decode steps of rows of one length (batch 1 always) attend every cached column, so they run without a mask;
    rows of different lengths keep theirs. Either way the logits equal HF's full forward."""
    import citer.decoding.lean as lean_mod

    _, _, llm = pair
    masks: list[object] = []
    sdpa = lean_mod.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    for seqs in ([[5, 9, 2, 7], [4, 4, 8, 1]], [[5, 9, 2, 7]], [[5, 9, 2, 7], [4, 8]]):
        cache = KVPool(llm, len(seqs), 16)
        with torch.inference_mode():
            ModelRunner(llm).feed(cache, seqs)
            masks.clear()
            monkeypatch.setattr(lean_mod.F, "scaled_dot_product_attention", spy)
            logits, _ = ModelRunner(llm).feed(cache, [[11]] * len(seqs))  # (b, V)
            monkeypatch.undo()
        equal = len({len(s) for s in seqs}) == 1
        assert masks and all((m is None) == equal for m in masks)
        for r, s in enumerate(seqs):
            torch.testing.assert_close(logits[r], hf_logits(llm, s + [11])[-1], atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_hf_generate(pair):
    fam, slm, llm = pair
    eng = RoutedEngine(slm, llm, AlwaysLLM(), vocab_size=V)
    assert eng.forward_paths == {"slm": "lean", "llm": "lean"}
    res = eng.generate_batch(PROMPTS, 16)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            out = llm.generate(
                torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                suppress_tokens=list(range(V, llm.config.vocab_size)) or None,
            )  # fmt: skip
        assert res.tokens[i] == out[0, len(p) :].tolist(), fam


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_routed_tokens_equal_through_either_forward(pair, temperature):
    """Routed decoding (both models write) with greedy and seeded sampling: the lean forward and the HF modules give
    the same tokens (the sampler is the engine's own, so HF ``generate`` draws differ by construction)."""
    _, slm, llm = pair
    out = {}
    for path in ("hf", "eager"):
        eng = RoutedEngine(slm, llm, RandomRouter(0.3, seed=0), vocab_size=V, forward=path)
        want = (
            {"slm": "hf: forward='hf'", "llm": "hf: forward='hf'"}
            if path == "hf"
            else {"slm": "lean", "llm": "lean"}
        )
        assert eng.forward_paths == want
        out[path] = eng.generate_batch(PROMPTS, 20, temperature=temperature, seed=7)
    assert out["hf"].tokens == out["eager"].tokens
    assert out["hf"].from_llm == out["eager"].from_llm
    assert any(any(r) for r in out["eager"].from_llm) and not all(all(r) for r in out["eager"].from_llm)


def test_weights_are_views_not_copies_and_moves_rebuild():
    model = build("qwen2", seed=3)
    dec = lean_decoder(model)
    assert dec is not None
    attn = model.model.layers[0].self_attn
    base = dec.layers[0].wqkv.untyped_storage().data_ptr()
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert (
            lin.weight.untyped_storage().data_ptr() == base
        )  # the HF parameters now live in the fused matrix
    ids = PROMPTS[0]
    lean = ModelRunner(model).forward(torch.tensor([ids]))[0][0]
    torch.testing.assert_close(lean, hf_logits(model, ids), atol=1e-5, rtol=1e-5)
    model.to(torch.float64)  # moved weights: the old view is stale and must not be used
    dec64 = lean_decoder(model)
    assert dec64 is not dec and dec64.layers[0].wqkv.dtype == torch.float64
    lean64 = ModelRunner(model).forward(torch.tensor([ids]))[0][0]
    torch.testing.assert_close(lean64, hf_logits(model, ids), atol=1e-9, rtol=1e-9)


def test_uncovered_models_keep_the_hf_forward_and_say_why():
    dynamic = build("qwen2", seed=4)
    dynamic.config.rope_parameters = {**dynamic.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    assert ModelRunner(dynamic).path.startswith("hf: rope_type 'dynamic'")
    training = build("qwen2", seed=5).train()
    assert ModelRunner(training).path == "hf: model in training mode (dropout)"
    # An engine over an uncovered model still decodes, through the HF modules, with HF's tokens.
    slm = build("qwen2", seed=7, layers=1)
    training.config.rope_parameters = dict(dynamic.config.rope_parameters)  # uncovered in eval mode too
    eng = RoutedEngine(slm, training.eval(), AlwaysLLM())
    assert eng.forward_paths["llm"].startswith("hf: rope_type 'dynamic'")
    res = eng.generate(PROMPTS[0], 8)
    with torch.no_grad():
        out = training.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert res.tokens[0] == out[0, len(PROMPTS[0]) :].tolist()
