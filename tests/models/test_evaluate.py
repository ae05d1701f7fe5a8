"""Evaluating one model alone: batched left-padded greedy decoding equals one-by-one decoding, grading is real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_qwen2

from citer.data.prompts import build_prompt, build_target
from citer.models.evaluate import EvalError, evaluate_model, generate_greedy, write_models_report
from citer.ops.io import read_json

ROWS = [
    {"id": "a", "problem": "2 + 2?", "solution": "2 + 2 = 4. So the answer is \\boxed{4}."},
    {"id": "b", "problem": "What is 3 + 5 in all, counting twice?", "solution": "3 + 5 = 8. So \\boxed{8}."},
    {"id": "c", "problem": "1 + 1?", "solution": "1 + 1 = 2. \\boxed{2}."},
]


def _overfit(tok, row, steps=120, fmt="math"):
    """A tiny real model trained until it writes ``row``'s target after its prompt."""
    model = make_qwen2(len(tok), hidden_size=32, num_hidden_layers=1, seed=0).train()
    with torch.no_grad():  # undo the fixture's large init scale: it slows convergence
        for p in model.parameters():
            p.div_(4.0 if p.dim() > 1 else 1.0)
    ids = tok.encode(build_prompt(row, fmt) + build_target(row, fmt), add_special_tokens=False)
    ids = torch.tensor([ids + [tok.eos_token_id]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_batched_generation_equals_one_by_one(tiny_pair, char_tokenizer):
    _, llm, tok = tiny_pair
    prompts = [build_prompt(r, "math") for r in ROWS]  # different lengths: real left padding
    batched = generate_greedy(llm, tok, prompts, batch_size=3, max_new_tokens=12)
    single = [generate_greedy(llm, tok, [p], batch_size=1, max_new_tokens=12)[0] for p in prompts]
    assert batched == single
    for toks in batched:
        assert tok.eos_token_id not in toks[:-1] and 0 < len(toks) <= 12


def test_a_model_that_learnt_the_answer_is_graded_correct(char_tokenizer):
    tok = char_tokenizer
    model = _overfit(tok, ROWS[0])
    ev = evaluate_model(model, tok, [ROWS[0], ROWS[2]], "math", batch_size=2, max_new_tokens=48)
    first, other = ev.predictions
    assert first.text.strip() == ROWS[0]["solution"] and first.extracted == "4" and first.correct
    assert not other.correct  # it writes "4" for a question whose answer is 2
    assert ev.accuracy == 0.5 and ev.n == 2 and ev.n_correct == 1
    assert [p.id for p in ev.predictions] == ["a", "c"]
    assert ev.tokens_generated == sum(p.n_tokens for p in ev.predictions)
    assert set(ev.metrics()) >= {"accuracy", "n", "seconds"} and ev.prediction_rows()[0]["correct"] is True


def test_mc_rows_are_graded_by_label(char_tokenizer):
    tok = char_tokenizer
    row_b = {"question": "Pick", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"}
    model = _overfit(tok, row_b, fmt="mc")
    # The prompt leaves out answerKey, so both rows get the same text; only the key decides the grade.
    row_a = dict(row_b, answerKey="A")
    ev = evaluate_model(model, tok, [row_b, row_a], "mc", batch_size=2, max_new_tokens=24)
    assert [p.text.strip() for p in ev.predictions] == ["The answer is B."] * 2
    assert [p.extracted for p in ev.predictions] == ["B", "B"]
    assert [p.correct for p in ev.predictions] == [True, False]
    assert ev.accuracy == 0.5 and ev.n_correct == 1


def test_empty_rows_and_bad_batch_size_are_refused(tiny_pair):
    _, llm, tok = tiny_pair
    with pytest.raises(EvalError, match="no rows"):
        evaluate_model(llm, tok, [], "math", 4, 4)
    with pytest.raises(EvalError, match="batch_size"):
        evaluate_model(llm, tok, ROWS, "math", 0, 4)


def test_models_report_has_the_agreed_keys(tmp_path):
    path = tmp_path / "reports" / "models.json"
    assert write_models_report(path, 1000, 0.25, 9000, 0.95, 12.5)["seconds"] == 12.5
    assert (
        read_json(path)
        == {
            "slm": {"params": 1000, "test_accuracy": 0.25},
            "llm": {"params": 9000, "test_accuracy": 0.95},
        }
    )  # the seconds are this run's, not a result: beside it in provenance.json, so two runs write the same file
    assert sorted(p.name for p in path.parent.iterdir()) == ["models.json", "provenance.json"]
    assert read_json(path.parent / "provenance.json")["run_facts"]["eval_models"]["seconds"] == 12.5


def test_stage_loads_each_model_as_params_say(prefect_server, project, tiny_pair_dirs, monkeypatch):
    """eval_models honours models.dtype/device/trust_remote_code and the LLM's device_map, as the other stages do."""
    import citer.models.loading as loading
    from flows.evaluate_models import eval_models_flow

    calls, real = [], loading.load_model

    def spy(ref, dtype="float32", device="cpu", trust_remote_code=False):
        calls.append((Path(ref).name, dtype, device, trust_remote_code))
        return real(ref, dtype, device, trust_remote_code)

    monkeypatch.setattr(loading, "load_model", spy)
    data = project / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    slm, llm = tiny_pair_dirs
    params = {
        "data": {"format": "math", "train": str(data), "dev": str(data), "test": str(data)},
        "synth": {"enabled": False},
        "bootstrap": {"enabled": False},
        "finetune": {"enabled": False},
        "models": {"slm": str(slm), "llm": str(llm), "dtype": "bfloat16", "llm_device_map": {"": "cpu"}},
        "eval": {"batch_size": 2, "max_new_tokens": 4, "n_examples": 2, "llm_chance_margin": None},
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    report = eval_models_flow("params.yaml")
    assert calls == [("slm", "bfloat16", "cpu", False), ("llm", "bfloat16", {"": "cpu"}, False)]
    assert report["slm"]["params"] < report["llm"]["params"]
    # the file holds the results; the seconds are the run's (provenance.json's run_facts)
    assert read_json(project / "reports" / "models.json") == {
        k: v for k, v in report.items() if k != "seconds"
    }
