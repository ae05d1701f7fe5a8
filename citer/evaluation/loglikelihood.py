"""Multiple-choice grading without generation: each choice's routed log-likelihood after the question, the likeliest
choice is the answer (what lm-evaluation-harness does for ARC, MMLU, CommonsenseQA).

A choice is scored as the continuation ``build_target`` gives a row whose answer is that choice and which carries no
chain of thought, `` The answer is {label}.``, after ``build_prompt``'s question; every token is scored by the model
the router picks at that position (:mod:`citer.decoding.scoring`). ``accuracy_norm`` divides each choice's
log-likelihood by its length in characters first (the harness's ``acc_norm``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from citer.data.prompts import build_prompt, build_target
from citer.decoding.scoring import routed_loglikelihood_batch
from citer.ops.progress import progress


def choice_continuations(row: Mapping[str, Any]) -> list[str]:
    """The continuation scored for each choice of an mc row, in label order."""
    return [build_target({"answerKey": lab}, "mc") for lab in row["choices"]["label"]]


def grade_mc(
    engine: Any, tokenizer: Any, rows: Sequence[Mapping[str, Any]], *, batch_rows: int = 16
) -> dict[str, Any]:
    """Grade mc ``rows`` by routed log-likelihood. Returns accuracy, ``accuracy_norm``, the share of scored tokens
    the router gave the LLM, and one prediction per row (id, predicted label, per-choice log-likelihoods)."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    preds: list[dict[str, Any]] = []
    right = right_norm = scored = to_llm = 0
    for start in progress(range(0, len(rows), batch_rows), desc="mc loglikelihood", unit="batch"):
        chunk = rows[start : start + batch_rows]
        items, spans, texts = [], [], []
        for r in chunk:
            ctx = tokenizer.encode(build_prompt(r, "mc"), add_special_tokens=False)
            conts = choice_continuations(r)
            spans.append((len(items), len(items) + len(conts)))
            texts.append(conts)
            # One row id per question: a random router draws the same coins for each of its choices.
            items += [(ctx, tokenizer.encode(c, add_special_tokens=False)) for c in conts]
        ids = [start + i for i, (a, b) in enumerate(spans) for _ in range(b - a)]
        scores = routed_loglikelihood_batch(engine, items, row_ids=ids)
        for r, (a, b), conts in zip(chunk, spans, texts, strict=True):
            totals = [s.total for s in scores[a:b]]
            norm = [t / max(len(c), 1) for t, c in zip(totals, conts, strict=True)]
            labels = list(r["choices"]["label"])
            pick, pick_norm = labels[totals.index(max(totals))], labels[norm.index(max(norm))]
            gold = str(r["answerKey"]).strip()
            right += pick == gold
            right_norm += pick_norm == gold
            for s in scores[a:b]:
                scored += len(s.from_llm)
                to_llm += sum(s.from_llm)
            preds.append({"id": r.get("id"), "pred": pick, "gold": gold, "loglikelihoods": totals})
    n = len(rows)
    return {
        "n_examples": n,
        "accuracy": right / n if n else 0.0,
        "accuracy_norm": right_norm / n if n else 0.0,
        "llm_token_fraction": to_llm / scored if scored else 0.0,
        "predictions": preds,
    }
