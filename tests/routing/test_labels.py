"""Token-level preference collection on real tiny Qwen2 models.

Two kinds of model: the random tiny pair of conftest (alignment against per-token ``generate``), and "lookup" models:
real Qwen2 weights set so that the greedy next token is a chosen function of the current token (attention and MLP
write nothing, embeddings are one-hot, lm_head is a lookup table). With them the expected cases, rollouts and labels
can be computed by hand and compared with what collection produces.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_qwen2

from citer.config import LabelsParams
from citer.data.answers import grade
from citer.decoding.runner import ModelRunner
from citer.routing.label_store import LabelsError, validate_labels
from citer.routing.labels import (
    Branch,
    citer_s_labels,
    collect_iter1,
    collect_iter_k,
    encode_rows,
    teacher_forced,
)

EOS = "<eos>"
# SLM: from a space it writes "\boxed{7}" then EOS; any other unknown char -> space.  LLM: the same box with 8, and
# digits count up (d -> d+1), "+" -> "5", "=" -> "8". Every chain ends in EOS within a few tokens.
SLM_MAP = {
    " ": "\\",
    "\\": "b",
    "b": "o",
    "o": "x",
    "x": "e",
    "e": "d",
    "d": "{",
    "{": "7",
    "7": "}",
    "}": EOS,
}
LLM_MAP = dict(SLM_MAP, **{"{": "8", "8": "}", "+": "5", "=": "8"})
LLM_MAP.update({str(d): str(d + 1) for d in range(8) if str(d) not in LLM_MAP})
LLM_MAP["9"] = "0"


def lookup_next(mapping: dict[str, str], c: str) -> str:
    return mapping.get(c, " ")


def make_lookup_model(tok, mapping: dict[str, str], seed: int = 0):
    """A Qwen2ForCausalLM whose argmax after token c is mapping[c] (default: space), whatever the context."""
    v = len(tok)
    h = 128  # >= vocab so embeddings can be one-hot
    model = make_qwen2(v, hidden_size=h, num_hidden_layers=1, seed=seed)
    vocab = tok.get_vocab()
    with torch.no_grad():
        for layer in model.model.layers:  # blocks add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        emb.zero_()
        emb[torch.arange(v), torch.arange(v)] = 1.0
        model.model.norm.weight.fill_(1.0)
        w = model.get_output_embeddings().weight  # (V, H)
        w.zero_()
        inv = {i: t for t, i in vocab.items()}
        for i in range(v):
            w[vocab[lookup_next(mapping, inv[i])], i] = 1.0
    return model.eval()


@pytest.fixture(scope="module")
def lookup_pair(char_tokenizer):
    return make_lookup_model(char_tokenizer, SLM_MAP, 1), make_lookup_model(char_tokenizer, LLM_MAP, 2)


ROWS = [
    {"problem": "3+5", "solution": "3+5=8. \\boxed{8}"},
    {"problem": "3+4", "solution": "3+4=7. \\boxed{7}"},
    {"problem": "9+0", "solution": "9+0=9, \\boxed{9}"},
]


def expected_cases(tok, rows):
    """(example, position, case, slm_char, llm_char) per target token, from the lookup tables alone."""
    out = []
    for i, e in enumerate(encode_rows(tok, rows, "math")):
        seq = e.prompt + e.target
        for t, ref in enumerate(e.target):
            prev = tok.convert_ids_to_tokens(seq[len(e.prompt) - 1 + t])
            s, m = lookup_next(SLM_MAP, prev), lookup_next(LLM_MAP, prev)
            r = tok.convert_ids_to_tokens(ref)
            case = "slm_correct" if s == r else "llm_correct" if m == r else "both_wrong"
            out.append((i, t, case, s, m))
    return out


def simulate(tok, row_target: str, position: int, first: str, use_slm, max_new: int = 32) -> str:
    """Greedy routed decoding with lookup models: after ``first``, each next char comes from SLM or LLM."""
    text, c = row_target[:position] + ("" if first == EOS else first), first
    for _ in range(max_new if c != EOS else 0):
        c = lookup_next(SLM_MAP if use_slm(c) else LLM_MAP, c)
        if c == EOS:
            break
        text += c
    return text


# ------------------------------------------------------------------------------------------------------------------


def test_teacher_forced_matches_per_token_generate(tiny_pair):
    slm, llm, tok = tiny_pair
    rows = [
        {"problem": "2+2", "solution": "4 \\boxed{4}"},
        {"problem": "10-3 and more", "solution": "7 \\boxed{7}"},
    ]
    enc = encode_rows(tok, rows, "math")
    # One padded batch holding examples of unequal length.
    tf = teacher_forced(slm, llm, enc, batch_size=2, pad_id=tok.pad_token_id)
    assert len(tf.ref) == sum(len(e.target) for e in enc)
    assert tf.hidden.shape == (len(tf.ref), slm.config.hidden_size)
    k = 0
    for i, e in enumerate(enc):
        assert e.target[-1] == tok.eos_token_id
        for t in range(len(e.target)):
            prefix = torch.tensor([e.prompt + e.target[:t]])
            assert (int(tf.example_index[k]), int(tf.position[k]), int(tf.ref[k])) == (i, t, e.target[t])
            for model, got in ((slm, tf.slm_token[k]), (llm, tf.llm_token[k])):
                gen = model.generate(prefix, max_new_tokens=1, do_sample=False, pad_token_id=0)
                assert int(gen[0, -1]) == int(got), (i, t)
            with torch.no_grad():  # the engine's router input on the unpadded prefix
                _, h = ModelRunner(slm).forward(prefix, last_index=torch.tensor([prefix.shape[1] - 1]))
            h = h[0]
            torch.testing.assert_close(tf.hidden[k], h, atol=1e-4, rtol=1e-4)
            k += 1


def test_iter1_cases_and_rollout_labels(lookup_pair, char_tokenizer):
    slm, llm, tok = *lookup_pair, char_tokenizer
    ls = collect_iter1(slm, llm, tok, ROWS, "math", LabelsParams(batch_size=2, max_new_tokens=32))
    exp = expected_cases(tok, ROWS)
    got = ls.tokens
    assert list(got["case"]) == [c for _, _, c, _, _ in exp]
    assert set(got["case"]) == {"slm_correct", "llm_correct", "both_wrong"}
    assert list(got["position"]) == [t for _, t, _, _, _ in exp]
    assert list(got["example_id"]) == [str(i) for i, *_ in exp]
    targets = [f" {r['solution']}" for r in ROWS]
    for (i, t, case, s, _), label in zip(exp, got["label"], strict=True):
        if case == "both_wrong":  # SLM-only rollout from prefix + the SLM's token, graded
            text = simulate(tok, targets[i], t, s, lambda c: True)
            assert label == int(grade(text, ROWS[i], "math")), (i, t, text)
        else:
            assert label == (1 if case == "slm_correct" else 0)
    # The SLM boxes 7: row 1 (answer 7) has SLM-preferred both_wrong tokens, row 0 (answer 8) none
    bw = got[got["case"] == "both_wrong"]
    assert 1 in set(bw[bw["example_id"] == "1"]["label"]) and set(bw[bw["example_id"] == "0"]["label"]) == {0}
    assert ls.meta["n_rollouts"] == len(bw) and ls.meta["iteration"] == 1
    assert ls.hidden.dtype == torch.float16 and ls.hidden.shape == (len(exp), 128)
    assert validate_labels(ls, 128)["success"]


def test_citer_s_labels_both_wrong_llm(lookup_pair, char_tokenizer):
    slm, llm, tok = *lookup_pair, char_tokenizer
    full = collect_iter1(slm, llm, tok, ROWS, "math", LabelsParams(batch_size=8))
    direct = collect_iter1(slm, llm, tok, ROWS, "math", LabelsParams(citer_s=True))
    derived = citer_s_labels(full)
    for ls in (direct, derived):
        bw = ls.tokens["case"] == "both_wrong"
        assert (ls.tokens.loc[bw, "label"] == 0).all() and ls.meta["citer_s"] and ls.meta["n_rollouts"] == 0
        assert (ls.tokens.loc[~bw, "label"] == full.tokens.loc[~bw, "label"]).all()
    assert list(direct.tokens["label"]) == list(derived.tokens["label"])
    assert (full.tokens.loc[full.tokens["case"] == "both_wrong", "label"] == 1).any()  # so CITER-S differs
    with pytest.raises(LabelsError, match="one-step"):
        collect_iter_k(derived, lambda h: torch.ones(h.shape[0]), slm, llm, tok, ROWS, "math", LabelsParams())


def box_router(tok):
    """Scores 0 (-> LLM) when the SLM's current token is "{" or "8": reads the one-hot hidden state.

    The routed rollout then writes the LLM's box "{8}" instead of the SLM's "{7}", flipping iteration-1 labels.
    """
    ids = torch.tensor([tok.get_vocab()[c] for c in "{8"])

    def route(hidden: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B,)
        return (~torch.isin(hidden.float().argmax(-1), ids.to(hidden.device))).float()

    return route


def expected_iter2(tok, prev, rollout_llm_token: bool) -> dict[int, int]:
    """Iteration-2 label per both_wrong row of ``prev`` under the box router, from the lookup tables alone."""
    targets = [f" {r['solution']}" for r in ROWS]
    is_slm = lambda c: c not in "{8"  # noqa: E731 - the box router in char terms
    out = {}
    for idx in prev.tokens.index[prev.tokens["case"] == "both_wrong"]:
        r = prev.tokens.loc[idx]
        i, t = int(r["example_id"]), int(r["position"])
        ok = {
            col: bool(
                grade(
                    simulate(tok, targets[i], t, tok.convert_ids_to_tokens(int(r[col])), is_slm),
                    ROWS[i],
                    "math",
                )
            )
            for col in ("slm_token", "llm_token")
        }
        if ok["slm_token"]:
            out[idx] = 1
        elif not rollout_llm_token:
            out[idx] = 0
        else:  # the LLM's branch: right -> LLM; wrong too -> the previous label stands
            out[idx] = 0 if ok["llm_token"] else int(r["label"])
    return out


@pytest.mark.parametrize("rollout_llm_token", [False, True])
def test_iter2_relabels_only_both_wrong(lookup_pair, char_tokenizer, rollout_llm_token):
    slm, llm, tok = *lookup_pair, char_tokenizer
    p = LabelsParams(batch_size=4, max_new_tokens=32, tau=0.5, rollout_llm_token=rollout_llm_token)
    prev = collect_iter1(slm, llm, tok, ROWS, "math", p)
    nxt = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", p)
    assert nxt.iteration == 2 and nxt.hidden is prev.hidden
    bw = prev.tokens["case"] == "both_wrong"
    for col in ("example_id", "position", "case", "row"):
        assert list(nxt.tokens[col]) == list(prev.tokens[col])
    assert (
        (nxt.tokens.loc[~bw, ["label", "iteration"]] == prev.tokens.loc[~bw, ["label", "iteration"]])
        .all()
        .all()
    )
    assert (nxt.tokens.loc[bw, "iteration"] == 2).all()
    expected = expected_iter2(tok, prev, rollout_llm_token)
    assert {i: int(nxt.tokens.loc[i, "label"]) for i in expected} == expected
    n_changed = int((nxt.tokens["label"] != prev.tokens["label"]).sum())
    assert n_changed > 0 and nxt.meta["n_changed"] == n_changed
    slm_failed = [i for i in expected if expected_iter2(tok, prev, False)[i] == 0]
    llm_rollouts = sum(
        int(prev.tokens.loc[i, "llm_token"] != prev.tokens.loc[i, "slm_token"]) for i in slm_failed
    )
    assert nxt.meta["n_rollouts"] == int(bw.sum()) + (llm_rollouts if rollout_llm_token else 0)
    if rollout_llm_token:
        o = nxt.meta["outcomes"]
        assert o["slm_ok"] + o["only_llm_ok"] + o["neither_ok"] == int(bw.sum())


def test_rollout_llm_token_keeps_labels_the_llm_cannot_fix(lookup_pair, char_tokenizer):
    """Built so the flag matters: on row 1 (answer 7) the SLM-only rollouts of iteration 1 box 7 (label SLM); under
    the box router both branches box 8 (wrong), so flag off flips those tokens to LLM and flag on keeps them SLM."""
    slm, llm, tok = *lookup_pair, char_tokenizer
    off = LabelsParams(batch_size=4, max_new_tokens=32, tau=0.5)
    on = off.model_copy(update={"rollout_llm_token": True})
    prev = collect_iter1(slm, llm, tok, ROWS, "math", off)
    a = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", off)
    b = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", on)
    differ = a.tokens.index[a.tokens["label"] != b.tokens["label"]]
    assert len(differ) > 0
    assert set(a.tokens.loc[differ, "example_id"]) == {"1"}
    assert (prev.tokens.loc[differ, "label"] == 1).all() and (b.tokens.loc[differ, "label"] == 1).all()
    assert (a.tokens.loc[differ, "label"] == 0).all()
    assert b.meta["n_changed"] < a.meta["n_changed"] and b.meta["outcomes"]["neither_ok"] >= len(differ)


def test_iter_k_refuses_other_rows(lookup_pair, char_tokenizer):
    slm, llm, tok = *lookup_pair, char_tokenizer
    prev = collect_iter1(slm, llm, tok, ROWS, "math", LabelsParams(citer_s=True))
    prev.meta["citer_s"] = False
    other = [dict(ROWS[0], solution="3+5=8 \\boxed{8}")] + ROWS[1:]
    with pytest.raises(LabelsError, match="rows_hash"):
        collect_iter_k(prev, lambda h: torch.ones(h.shape[0]), slm, llm, tok, other, "math", LabelsParams())


def test_mc_format_and_n_examples(tiny_pair):
    slm, llm, tok = tiny_pair
    rows = [
        {
            "question": f"Pick {k}?",
            "choices": {"label": ["A", "B"], "text": ["x", "y"]},
            "answerKey": "AB"[k % 2],
        }
        for k in range(5)
    ]
    ls = collect_iter1(slm, llm, tok, rows, "mc", LabelsParams(n_examples=3, batch_size=2, max_new_tokens=8))
    assert sorted(set(ls.tokens["example_id"])) == ["0", "1", "2"]
    enc = encode_rows(tok, rows[:3], "mc")
    assert ls.n_tokens == sum(len(e.target) for e in enc)
    assert ls.meta["fmt"] == "mc" and ls.meta["n_examples"] == 3
    assert validate_labels(ls, slm.config.hidden_size)["success"]


def test_bad_rows(tiny_pair):
    slm, llm, tok = tiny_pair
    with pytest.raises(LabelsError, match="row 2: field 'solution'"):
        encode_rows(tok, [{"problem": "a", "solution": "\\boxed{1}"}, {"problem": "b"}], "math")
    with pytest.raises(LabelsError, match="empty input"):
        collect_iter1(slm, llm, tok, [], "math", LabelsParams())
    long = [{"problem": "x" * 600, "solution": "\\boxed{1}"}]
    with pytest.raises(LabelsError, match="row 1: field prompt\\+target has .* max_position_embeddings=512"):
        collect_iter1(slm, llm, tok, long, "math", LabelsParams(citer_s=True))


def test_branch_is_hashable_record():
    import dataclasses

    a = Branch(0, 1, 2)
    assert (a.ex, a.position, a.token) == (0, 1, 2)
    # Equal by value, so a branch built again finds the same key; each field tells branches apart.
    assert hash(Branch(0, 1, 2)) == hash(a)
    outcome = {a: True, Branch(1, 1, 2): False, Branch(0, 2, 2): False, Branch(0, 1, 3): False}
    assert len(outcome) == 4 and outcome[Branch(0, 1, 2)] is True
    assert {Branch(0, 1, 2), Branch(0, 1, 2), Branch(2, 1, 0)} == {a, Branch(2, 1, 0)}
    # A key mutated after insertion would be lost in its dict: the record must refuse it.
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.token = 5  # type: ignore[misc]


def test_iter2_with_trained_mlp_router(lookup_pair, tiny_pair, char_tokenizer, tmp_path):
    """The MLP router drives the engine's rollouts (loaded back from disk); a mismatched SLM is refused."""
    from citer.config import RouterParams
    from citer.routing.mlp import load_router, router_meta, save_router, train_router

    slm, llm, tok = *lookup_pair, char_tokenizer
    p = LabelsParams(batch_size=8, max_new_tokens=32)
    rows = ROWS * 4  # enough examples for a split by example
    prev = collect_iter1(slm, llm, tok, rows, "math", p)
    router, metrics = train_router(prev, RouterParams(epochs=3, batch_size=16))
    save_router(router, tmp_path / "r", router_meta(prev, metrics))
    loaded, _ = load_router(tmp_path / "r", expected_hidden_size=128)
    nxt = collect_iter_k(prev, loaded, slm, llm, tok, rows, "math", p)
    assert nxt.iteration == 2 and validate_labels(nxt, 128)["success"]
    assert nxt.meta["n_rollouts"] == int((prev.tokens["case"] == "both_wrong").sum())
    other_slm = tiny_pair[0]  # hidden size 32, same tokenizer
    with pytest.raises(LabelsError, match="hidden has size 128, the SLM's is 32"):
        collect_iter_k(prev, loaded, other_slm, llm, tok, rows, "math", p)


# ------------------------------------------------------------------- the exact table, meta and errors (scripts/mutation.py)


def test_encode_rows_adds_no_special_tokens_and_one_eos(char_tokenizer):
    """A tokenizer that adds special tokens by default (here: EOS first) adds none to prompt or target."""
    from conftest import make_char_tokenizer
    from tokenizers import processors

    from citer.data.prompts import build_prompt, build_target

    tok = make_char_tokenizer()
    eos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", eos)]
    )
    assert tok.encode("ab") == [eos] + tok.encode("ab", add_special_tokens=False)
    (e,) = encode_rows(tok, ROWS[:1], "math")
    assert e.prompt == char_tokenizer.encode(build_prompt(ROWS[0], "math"), add_special_tokens=False)
    assert e.target == char_tokenizer.encode(build_target(ROWS[0], "math"), add_special_tokens=False) + [eos]


def test_encode_rows_names_the_row_at_fault(char_tokenizer):
    from citer.data.origin import Row

    with pytest.raises(LabelsError, match="^train.jsonl:7: field 'solution' missing for format 'math'$"):
        encode_rows(char_tokenizer, [Row({"problem": "1+1"}, "train.jsonl", 7)], "math")

    class Mute:  # a tokenizer that knows none of the prompt's characters and drops them
        eos_token_id = 1

        def encode(self, text, add_special_tokens=True):
            return []

    with pytest.raises(LabelsError, match="^row 1: field prompt encodes to no tokens$"):
        encode_rows(Mute(), ROWS[:1], "math")


def test_rows_hash_is_stable_across_versions():
    """Label sets on disk carry it; iteration k compares it, so its value may not drift."""
    from citer.routing.labels import Encoded, rows_hash

    assert rows_hash([Encoded("0", [5, 6, 7], [8, 1]), Encoded("1", [9], [1])]) == "0bfbefac44642e4d"


def test_model_name_falls_back_to_the_config():
    from types import SimpleNamespace as NS

    from citer.routing.labels import model_name

    assert model_name(NS(name_or_path="models/slm", config=NS(_name_or_path="other"))) == "models/slm"
    assert model_name(NS(config=NS(_name_or_path="models/llm"))) == "models/llm"
    assert model_name(NS(config=NS())) == ""


def test_teacher_forced_batches_as_asked_and_any_batch_gives_the_same_tokens(tiny_pair, monkeypatch):
    slm, llm, tok = tiny_pair
    rows = [{"problem": f"{k}+{k}", "solution": f"{2 * k} \\boxed{{{2 * k}}}" + " so" * k} for k in range(5)]
    enc = encode_rows(tok, rows, "math")
    one = teacher_forced(slm, llm, enc, batch_size=1, pad_id=tok.pad_token_id)
    calls = {"slm": 0, "llm": 0}
    for name, model in (("slm", slm), ("llm", llm)):
        decoder = model.get_decoder()

        def counted(name=name, decoder=decoder):
            calls[name] += 1
            return decoder

        monkeypatch.setattr(model, "get_decoder", counted)
    three = teacher_forced(slm, llm, enc, batch_size=3, pad_id=tok.pad_token_id)  # 3 examples share a batch
    assert calls == {"slm": 2, "llm": 2}
    for f in ("example_index", "position", "ref", "slm_token", "llm_token"):
        assert torch.equal(getattr(three, f), getattr(one, f)), f
    torch.testing.assert_close(three.hidden, one.hidden, atol=1e-4, rtol=1e-4)


def padded(model, v: int, extra: int = 8):
    """``model`` with its embeddings padded by ``extra`` ids past the tokenizer's ``v``, ids that would win every
    argmax if the logits were not cut to ``v`` (lookup models: the logit of a real id is at most sqrt(H))."""
    model.resize_token_embeddings(v + extra)
    with torch.no_grad():
        model.get_input_embeddings().weight[v:] = 0.0
        model.get_output_embeddings().weight[v:] = 2.0
    return model


def test_padded_embeddings_never_win_a_label(char_tokenizer):
    tok = char_tokenizer
    v = len(tok)
    plain = (make_lookup_model(tok, SLM_MAP, 1), make_lookup_model(tok, LLM_MAP, 2))
    pad = (padded(make_lookup_model(tok, SLM_MAP, 1), v), padded(make_lookup_model(tok, LLM_MAP, 2), v))
    enc = encode_rows(tok, ROWS, "math")
    ref = teacher_forced(*plain, enc, batch_size=2, pad_id=tok.pad_token_id)
    # Only the LLM padded: the default cut (the smaller embedding) would not reach it; the tokenizer's size does.
    got = teacher_forced(plain[0], pad[1], enc, batch_size=2, pad_id=tok.pad_token_id, vocab_size=v)
    assert torch.equal(got.llm_token, ref.llm_token) and torch.equal(got.slm_token, ref.slm_token)
    p = LabelsParams(batch_size=2, citer_s=True)
    a, b = collect_iter1(*plain, tok, ROWS, "math", p), collect_iter1(*pad, tok, ROWS, "math", p)
    assert a.tokens.equals(b.tokens)


class Recording:
    """A :class:`~citer.routing.labels.LabelWork` that runs in process and records how rollouts were asked for."""

    def __init__(self, work):
        self.work, self.routed = work, []
        self.hidden_size = work.hidden_size

    def teacher_forced(self, encoded, batch_size):
        return self.work.teacher_forced(encoded, batch_size)

    def rollouts(self, encoded, branches, routed, batch, max_new):
        self.routed.append(routed)
        return self.work.rollouts(encoded, branches, routed, batch, max_new)


def test_iteration_1_rolls_out_the_slm_alone_and_marks_every_token(lookup_pair, char_tokenizer):
    from citer.routing.labels import InProcessWork

    slm, llm, tok = *lookup_pair, char_tokenizer
    p = LabelsParams(batch_size=4, max_new_tokens=32)
    work = Recording(InProcessWork(slm, llm, tok, ROWS, "math"))
    ls = collect_iter1(slm, llm, tok, ROWS, "math", p, work=work)
    assert work.routed and not any(work.routed)  # no router yet: SLM-only rollouts
    assert set(ls.tokens["iteration"]) == {1}
    derived = citer_s_labels(ls)
    flipped = (ls.tokens["case"] == "both_wrong") & (ls.tokens["label"] == 1)
    assert derived.meta["n_changed"] == int(flipped.sum()) > 0


def test_iter_k_keeps_the_meta_and_the_examples_of_iteration_1(lookup_pair, char_tokenizer):
    slm, llm, tok = *lookup_pair, char_tokenizer
    p = LabelsParams(batch_size=4, max_new_tokens=32, tau=0.5, n_examples=2)
    prev = collect_iter1(slm, llm, tok, ROWS, "math", p)
    nxt = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", p)  # the first 2 rows again
    kept = {k: prev.meta[k] for k in ("fmt", "slm", "llm", "citer_s", "n_examples", "rows_hash")}
    assert {k: nxt.meta[k] for k in kept} == kept and nxt.meta["n_examples"] == 2
    assert nxt.meta["iteration"] == 2 and nxt.meta["tau"] == 0.5
    # A label set written before n_examples was recorded: every row is labelled again.
    full = collect_iter1(slm, llm, tok, ROWS, "math", p.model_copy(update={"n_examples": 0}))
    del full.meta["n_examples"]
    assert collect_iter_k(full, box_router(tok), slm, llm, tok, ROWS, "math", p).n_tokens == full.n_tokens
    with pytest.raises(LabelsError, match=f"field rows_hash={prev.meta['rows_hash']!r} does not match"):
        collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS[1:], "math", p)


def test_iter_k_without_both_wrong_tokens_changes_nothing(lookup_pair, char_tokenizer):
    slm, llm, tok = *lookup_pair, char_tokenizer
    p = LabelsParams(batch_size=4, max_new_tokens=32, tau=0.5)
    prev = collect_iter1(slm, llm, tok, ROWS, "math", p.model_copy(update={"citer_s": True}))
    prev.meta["citer_s"] = False
    prev.tokens.loc[prev.tokens["case"] == "both_wrong", "case"] = "llm_correct"
    nxt = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", p)
    assert nxt.tokens.equals(prev.tokens) and nxt.hidden is prev.hidden
    assert nxt.meta == dict(
        prev.meta, iteration=2, tau=0.5, rollout_llm_token=False, n_rollouts=0, n_changed=0
    )


def test_verified_rollouts_let_the_catch_up_repair_the_branch_token(lookup_pair, char_tokenizer):
    """The SLM's "7" in row 0's box is wrong; plain rollouts keep it (wrong answer), verified rollouts let the final
    check replace it by the LLM's "8" (right answer) -- so iteration k can label it SLM: the check repairs it."""
    from citer.decoding.baselines import AlwaysSLM
    from citer.decoding.engine import RoutedEngine
    from citer.routing.rollouts import rollout_correct

    slm, llm, tok = *lookup_pair, char_tokenizer
    enc = encode_rows(tok, ROWS[:1], "math")
    pos = len(enc[0].target) - 3  # ... "{", "8", "}", EOS: the boxed digit
    assert tok.convert_ids_to_tokens(enc[0].target[pos]) == "8"
    branch = [Branch(0, pos, tok.convert_tokens_to_ids("7"))]
    kw = dict(eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    plain = RoutedEngine(slm, llm, AlwaysSLM(), **kw)
    checked = RoutedEngine(slm, llm, AlwaysSLM(), verify_rho=1.0, verify_final=True, **kw)
    assert rollout_correct(plain, tok, enc, ROWS[:1], "math", branch, 4, 32) == [False]
    assert rollout_correct(checked, tok, enc, ROWS[:1], "math", branch, 4, 32) == [True]

    off = LabelsParams(batch_size=4, max_new_tokens=32, tau=0.5)
    on = off.model_copy(update={"verify_rho": 1.0, "verify_final": True})
    prev = collect_iter1(slm, llm, tok, ROWS, "math", off)
    a = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", off)
    b = collect_iter_k(prev, box_router(tok), slm, llm, tok, ROWS, "math", on)
    assert b.meta["rollout_verify"] == {"verify_rho": "1.0", "verify_window": "0", "verify_final": "True"}
    assert "rollout_verify" not in a.meta
    # the checks change what the rollouts find (on this pair mostly for the worse: the lookup LLM's own boxes are
    # wrong on rows 1 and 2, and its checks replace the SLM's tokens there)
    assert (b.tokens["label"] != a.tokens["label"]).any()
