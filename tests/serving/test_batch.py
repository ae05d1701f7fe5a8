"""Batch inference through the real routed engine on tiny models: output rows, bad input rows, resume after a kill."""

from __future__ import annotations

import json

import pytest
import torch

from citer.serving.batch import CHUNK_BATCHES, InferenceError, route_file

GOOD = [{"problem": f"{a} + {a % 4}", "solution": f"\\boxed{{{a + a % 4}}}", "id": f"q{a}"} for a in range(7)]


def _write_input(path, with_bad=True):
    lines = [json.dumps(r) for r in GOOD[:3]]
    if with_bad:
        lines += [
            '{"problem": "1 + 1", "solution": ',  # bad JSON (cut short)
            "",  # blank: skipped, no output row
            json.dumps({"solution": "\\boxed{2}"}),  # missing the question
            json.dumps({"problem": "2 + 2"}),  # no reference: routed, not graded
            json.dumps({"problem": 7, "solution": "\\boxed{7}"}),  # wrong type
        ]
    lines += [json.dumps(r) for r in GOOD[3:]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine(tiny_pair):
    from citer.decoding.engine import RoutedEngine
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = tiny_pair
    torch.manual_seed(0)
    router = MLPRouter(slm.config.hidden_size).eval()
    return RoutedEngine(
        slm, llm, router, tau=0.5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )


def _lines(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_route_file_rows_and_errors(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    inp = _write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out" / "pred.jsonl"
    s = route_file(engine, tok, inp, out, "math", batch_size=4, max_new_tokens=6, progress=False)
    rows = _lines(out)
    assert [r["index"] for r in rows] == list(range(11))
    errors = {r["line"]: r["error"] for r in rows if "error" in r}
    assert set(errors) == {4, 6, 8}
    assert "truncated line" in errors[4] or "JSON" in errors[4]
    assert errors[6] == "field 'problem': missing required key"
    assert errors[8] == "field 'problem': expected a string, got int"
    ok = [r for r in rows if "error" not in r]
    assert len(ok) == 8 and all("correct" in r for r in ok if r["line"] != 7)
    ungraded = next(r for r in rows if r["line"] == 7)
    assert "correct" not in ungraded and "response" in ungraded
    for r in ok:
        assert set(r) >= {
            "response",
            "answer",
            "n_tokens",
            "llm_tokens",
            "llm_token_fraction",
            "llm_calls",
            "bytes_moved",
        }
        assert 1 <= r["n_tokens"] <= 6 and 0 <= r["llm_token_fraction"] <= 1 and r["bytes_moved"] > 0
        # The token view: runs of one writer that join to the response, alternating writers.
        assert "".join(t for t, _ in r["spans"]) == r["response"]
        assert all(w in ("slm", "llm") for _, w in r["spans"])
        assert all(a[1] != b[1] for a, b in zip(r["spans"], r["spans"][1:], strict=False))
        assert (r["llm_tokens"] > 0) == any(w == "llm" for _, w in r["spans"]) or r["response"] == ""
    assert next(r for r in rows if r["line"] == 1)["id"] == "q0"
    assert s.n == 11 and s.n_errors == 3 and s.n_graded == 7 and s.n_processed == 11 and s.n_skipped == 0
    assert s.accuracy == sum(r["correct"] for r in ok if "correct" in r) / 7
    assert s.n_tokens == sum(r["n_tokens"] for r in ok)
    assert s.llm_token_fraction == pytest.approx(sum(r["llm_tokens"] for r in ok) / s.n_tokens)


def test_resume_after_kill_gives_the_same_file(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    inp = _write_input(tmp_path / "in.jsonl")
    full = tmp_path / "full.jsonl"
    route_file(engine, tok, inp, full, "math", batch_size=1, max_new_tokens=6, progress=False)
    reference = full.read_bytes()

    # A kill mid-write: the first chunk (CHUNK_BATCHES lines at batch_size 1) complete, then half of the next line.
    n = CHUNK_BATCHES
    killed = tmp_path / "killed.jsonl"
    route_file(engine, tok, inp, killed, "math", batch_size=1, max_new_tokens=6, progress=False)
    lines = reference.split(b"\n")
    killed.write_bytes(b"\n".join(lines[:n]) + b"\n" + lines[n][: len(lines[n]) // 2])
    s = route_file(engine, tok, inp, killed, "math", batch_size=1, max_new_tokens=6, progress=False)
    assert s.n_skipped == n and s.n_processed == 11 - n and s.n == 11
    assert killed.read_bytes() == reference

    # Rerunning a finished file decodes nothing and never builds an engine.
    def factory():
        raise AssertionError("the engine factory must not be called when nothing is left")

    s = route_file(factory, tok, inp, killed, "math", batch_size=1, max_new_tokens=6, progress=False)
    assert s.n_processed == 0 and s.n_skipped == 11 and killed.read_bytes() == reference


def test_resume_with_factory_and_no_newline_tail(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    inp = _write_input(tmp_path / "in.jsonl", with_bad=False)
    ref = tmp_path / "ref.jsonl"
    route_file(engine, tok, inp, ref, "math", batch_size=1, max_new_tokens=5, progress=False)
    part = tmp_path / "part.jsonl"
    first = ref.read_bytes().split(b"\n")
    # Chunk 0 and half of chunk 1 as whole lines, then one more line without its newline: chunk 1 is decoded again.
    n = CHUNK_BATCHES  # lines per chunk at batch_size 1
    part.write_bytes(b"\n".join(first[: n + n // 2]) + b"\n" + first[n + n // 2])
    calls = []

    def factory():
        calls.append(1)
        return engine

    s = route_file(factory, tok, inp, part, "math", batch_size=1, max_new_tokens=5, progress=False)
    assert calls == [1] and s.n_skipped == n and s.n_processed == len(GOOD) - n
    assert part.read_bytes() == ref.read_bytes()


def test_resume_refuses_another_input(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    a = _write_input(tmp_path / "a.jsonl", with_bad=False)
    out = tmp_path / "out.jsonl"
    route_file(engine, tok, a, out, "math", batch_size=4, max_new_tokens=4, progress=False)
    b = tmp_path / "b.jsonl"
    b.write_text(a.read_text().replace("1 + 1", "1 + 9"), encoding="utf-8")
    with pytest.raises(InferenceError, match="out.jsonl: was written for another run"):
        route_file(engine, tok, b, out, "math", batch_size=4, max_new_tokens=4, progress=False)
    with pytest.raises(InferenceError, match="max_new_tokens"):
        route_file(engine, tok, a, out, "math", batch_size=4, max_new_tokens=5, progress=False)


def test_restart_on_change_starts_over_for_another_champion(engine, tiny_pair, tmp_path):
    """What the pipeline does: predictions made for another router version (or input, or τ) are never resumed."""
    tok = tiny_pair[2]
    inp = _write_input(tmp_path / "in.jsonl", with_bad=False)
    out = tmp_path / "out.jsonl"
    route_file(engine, tok, inp, out, "math", batch_size=2, max_new_tokens=4, progress=False, meta={"v": "1"})
    ref = out.read_bytes()
    out.write_bytes(ref.split(b"\n")[0] + b"\n")  # a partial file from version 1
    again = dict(batch_size=2, max_new_tokens=4, progress=False, meta={"v": "2"}, restart_on_change=True)
    s = route_file(engine, tok, inp, out, "math", **again)
    assert s.n_skipped == 0 and s.n_processed == len(GOOD) and out.read_bytes() == ref
    assert json.loads(out.with_name("out.jsonl.meta.json").read_text())["v"] == "2"
    s = route_file(engine, tok, inp, out, "math", **again)  # same settings: resumed (nothing left)
    assert s.n_skipped == len(GOOD) and s.n_processed == 0


def test_corrupt_middle_line_is_refused(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    inp = _write_input(tmp_path / "in.jsonl", with_bad=False)
    out = tmp_path / "out.jsonl"
    route_file(engine, tok, inp, out, "math", batch_size=4, max_new_tokens=4, progress=False)
    lines = out.read_text().splitlines()
    lines[1] = "garbage"
    out.write_text("\n".join(lines) + "\n")
    with pytest.raises(InferenceError, match=r"out.jsonl:2: not an output row"):
        route_file(engine, tok, inp, out, "math", batch_size=4, max_new_tokens=4, progress=False)


def test_mc_questions(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    rows = [
        {"question": "Pick B", "choices": {"label": ["A", "B"], "text": ["x", "y"]}, "answerKey": "B"},
        {"question": "Pick A", "choices": {"label": ["A", "B"], "text": ["x", "y"]}},
        {"question": "Broken", "choices": {"label": ["A", "B"]}},
    ]
    inp = tmp_path / "mc.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    s = route_file(
        engine, tok, inp, tmp_path / "o.jsonl", "mc", batch_size=8, max_new_tokens=4, progress=False
    )
    out = _lines(tmp_path / "o.jsonl")
    assert "correct" in out[0] and "correct" not in out[1] and "choices.text" in out[2]["error"]
    assert s.n == 3 and s.n_errors == 1 and s.n_graded == 1


def test_too_long_prompt_is_an_error_row(engine, tiny_pair, tmp_path):
    tok = tiny_pair[2]
    rows = [GOOD[0], {"problem": "9 " * 400, "solution": "\\boxed{1}"}, GOOD[1]]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    s = route_file(
        engine, tok, inp, tmp_path / "o.jsonl", "math", batch_size=8, max_new_tokens=4, progress=False
    )
    out = _lines(tmp_path / "o.jsonl")
    assert "response" in out[0] and "response" in out[2]
    assert "longer than the" in out[1]["error"] and out[1]["line"] == 2
    assert s.n_errors == 1


def test_verified_routing_shows_the_tokens_it_took_back_beside_the_response(tiny_pair, tmp_path):
    from conftest import spread_router

    from citer.decoding.engine import RoutedEngine
    from citer.serving.batch import writer_spans

    slm, llm, tok = tiny_pair
    eng = RoutedEngine(
        slm,
        llm,
        spread_router(slm.config.hidden_size),
        tau=0.5,
        eos_token_id=tok.eos_token_id,
        verify_rho=1.0,
    )
    out = tmp_path / "out.jsonl"
    route_file(
        eng, tok, _write_input(tmp_path / "in.jsonl", with_bad=False), out, "math", 4, 12, progress=False
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(r["rolled_back_tokens"] for r in rows) > 0
    for r in rows:
        kept = [t for t, w in r["spans"] if w != "rolled_back"]
        assert "".join(kept) == r["response"]  # taken-back pieces sit beside the response, not in it
        assert any(w == "rolled_back" for _, w in r["spans"]) == (r["rolled_back_tokens"] > 0)
    # the piece is the text of the tokens taken back, where they were taken back
    ids = tok.encode("ab", add_special_tokens=False)
    gone = tok.encode("xy", add_special_tokens=False)
    spans = writer_spans(tok, ids, [False, True], [(1, gone)])
    assert spans == [["a", "slm"], ["xy", "rolled_back"], ["b", "llm"]]


def test_mc_response_naming_the_choice_text_is_graded_as_its_label(engine, tiny_pair, tmp_path, monkeypatch):
    """A model that answers with the choice's text ("The answer is 13.") is graded, and recorded, as its label."""
    import citer.serving.batch as batch

    tok = tiny_pair[2]
    real = batch._generate

    def answering(engine, pairs, max_new_tokens, batch_size):
        said = {0: " 13 is (C). So the answer is C.", 1: " The answer is 13.", 2: " The answer is 10."}
        out = []
        for (it, _), (_, st, _, _) in zip(
            pairs, real(engine, pairs, max_new_tokens, batch_size), strict=True
        ):
            toks = tok.encode(said[it.index], add_special_tokens=False)
            out.append((toks, st, [False] * len(toks), []))
        return out

    monkeypatch.setattr(batch, "_generate", answering)
    row = {
        "question": "q",
        "choices": {"label": list("ABCD"), "text": ["5", "10", "13", "8"]},
        "answerKey": "C",
    }
    inp = tmp_path / "mc.jsonl"
    inp.write_text("".join(json.dumps(row) + "\n" for _ in range(3)), encoding="utf-8")
    s = route_file(
        engine, tok, inp, tmp_path / "o.jsonl", "mc", batch_size=8, max_new_tokens=4, progress=False
    )
    out = _lines(tmp_path / "o.jsonl")
    assert [(r["answer"], r["correct"]) for r in out] == [("C", True), ("C", True), ("B", False)]
    assert s.n_graded == 3


@pytest.mark.parametrize("flag, shown", [("0", False), ("1", True), ("", False)])
def test_route_bar_follows_citer_progress(engine, tiny_pair, tmp_path, capfd, monkeypatch, flag, shown):
    """The route bar obeys CITER_PROGRESS like every other bar, and stays out of redirected stderr by default."""
    monkeypatch.setenv("CITER_PROGRESS", flag)
    inp = _write_input(tmp_path / "in.jsonl", with_bad=False)
    route_file(engine, tiny_pair[2], inp, tmp_path / "out.jsonl", "math", batch_size=4, max_new_tokens=2)
    assert ("route in.jsonl" in capfd.readouterr().err) == shown
