"""lm-evaluation-harness against a live ``citer`` server, offline: a generate task and a loglikelihood
(multiple-choice) task over a local JSONL file, both through the harness's own OpenAI-compatible clients.

The pair answers the two-digit task (``conftest.answering_rows``); the prompt is the tokenizer's chat template applied
by the harness (``apply_chat_template``), so nothing in the task repeats the training template."""

from __future__ import annotations

import json

import pytest
import yaml
from live import serving

from citer.data.prompts import CHAT_TEMPLATE

lm_eval = pytest.importorskip("lm_eval")

MODEL = "citer-lm-eval"
N = 30


def _task_files(root, rows) -> None:
    data = root / "two_digits.jsonl"
    lines = [
        {"problem": r["problem"], "answer": r["problem"][1], "label": int(r["problem"][1])} for r in rows
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # Fields named as such are read as they are (a template rendering to digits would be parsed as a number).
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "problem",
    }
    gen = {
        "task": "citer_gen",
        "output_type": "generate_until",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
        "filter_list": [
            {
                "name": "boxed",
                "filter": [
                    {"function": "regex", "regex_pattern": r"boxed\{(\d)\}"},
                    {"function": "take_first"},
                ],
            }
        ],
        "metric_list": [{"metric": "exact_match"}],
    }
    mc = {
        "task": "citer_mc",
        "output_type": "multiple_choice",
        "doc_to_choice": [f" \\boxed{{{d}}}" for d in range(10)],
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc"}],
    }
    for task in (gen, mc):
        (root / f"{task['task']}.yaml").write_text(yaml.safe_dump(common | task))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lm_eval_generate_and_loglikelihood_tasks_through_the_router(answering_pair, tmp_path):
    from conftest import answering_rows
    from lm_eval.tasks import TaskManager

    from citer.decoding.engine import RoutedEngine
    from citer.decoding.scoring import routed_loglikelihood
    from citer.serving.server import build_app

    p = answering_pair
    tok_dir = tmp_path / "tokenizer"
    p.tok.chat_template = (
        CHAT_TEMPLATE  # the embedded tokenizer carries it; the char tokenizer is given it here
    )
    try:
        p.tok.save_pretrained(tok_dir)
    finally:
        p.tok.chat_template = None
    _task_files(tmp_path, answering_rows(11, N))
    engine = RoutedEngine(p.slm, p.llm, p.router, tau=0.5, eos_token_id=p.tok.eos_token_id)
    app = build_app(engine, p.tok, model_name=MODEL, max_new_tokens=16, fmt="math")
    tasks = TaskManager(include_path=str(tmp_path))
    with serving(app) as base:
        args = {
            "model": MODEL,
            "base_url": f"{base}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tok_dir),
            "batch_size": 8,
            "max_length": 512,
        }
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["citer_gen", "citer_mc"],
            task_manager=tasks,
            apply_chat_template=True,
            log_samples=True,
            bootstrap_iters=0,
        )
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args={"model": MODEL, "base_url": f"{base}/v1/chat/completions"},
            tasks=["citer_gen"],
            task_manager=tasks,
            apply_chat_template=True,
            bootstrap_iters=0,
        )
    gen = out["results"]["citer_gen"]["exact_match,boxed"]
    mc = out["results"]["citer_mc"]["acc,none"]
    chat_gen = chat["results"]["citer_gen"]["exact_match,boxed"]
    print(
        f"lm-eval on {N} questions: generate {gen:.2f}, loglikelihood {mc:.2f}, chat generate {chat_gen:.2f}"
    )
    assert out["samples"]["citer_gen"][0]["arguments"][0][0].startswith(
        "Question: "
    )  # the tokenizer's template
    # The harness's score of a choice is the routed policy's teacher-forced log-likelihood of it.
    first = out["samples"]["citer_mc"][0]
    ctx = p.tok.encode(f"Question: {first['doc']['problem']}\nAnswer:", add_special_tokens=False)
    for d in (first["doc"]["label"], (first["doc"]["label"] + 1) % 10):
        cont = p.tok.encode(f" \\boxed{{{d}}}", add_special_tokens=False)
        want = routed_loglikelihood(engine, ctx, cont)
        assert first["resps"][d][0] == pytest.approx((want.total, want.greedy), abs=1e-4)
    # The LLM answers every question; the router sends it the answer token, so routed decoding answers most, and
    # the routed likelihood of the right boxed digit beats the nine others as often.
    assert gen >= 0.8 and chat_gen == gen
    assert mc >= 0.8
