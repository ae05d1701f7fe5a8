"""Evaluating one model alone: batched greedy generation, answers extracted and graded by ``citer.data.answers``.

The prompts are ``citer.data.prompts.build_prompt`` encoded without special tokens, exactly as in training, label
collection and routed decoding, so the accuracy here is the SLM-only / LLM-only end of the routing curve.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from citer.data.answers import extract_answer, grade
from citer.data.formats import Format
from citer.data.prompts import build_prompt
from citer.decoding.pairing import VocabCut, input_device
from citer.ops.progress import progress
from citer.tracking.provenance import write_results


class EvalError(ValueError):
    """Input evaluation cannot use (no rows, a batch size below one)."""


@dataclass
class Prediction:
    index: int  # row index in the evaluated list
    id: str | None  # the row's "id" when it has one
    text: str  # decoded new tokens, special tokens dropped
    extracted: str | None
    correct: bool
    n_tokens: int  # new tokens generated, EOS included


@dataclass
class ModelEval:
    accuracy: float
    n: int
    n_correct: int
    seconds: float
    tokens_generated: int
    predictions: list[Prediction] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a tracker (no per-row data)."""
        return {
            "accuracy": self.accuracy,
            "n": float(self.n),
            "n_correct": float(self.n_correct),
            "seconds": self.seconds,
            "tokens_generated": float(self.tokens_generated),
        }

    def prediction_rows(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.predictions]


@torch.no_grad()
def generate_greedy(
    model, tokenizer, prompts: Sequence[str], batch_size: int, max_new_tokens: int
) -> list[list[int]]:
    """New token ids per prompt (EOS included when emitted, nothing after it); greedy, left-padded batches.

    Prompts are processed in order of length so a batch carries little padding; results come back in input order.
    Tokens are chosen among the tokenizer's ids only (a padded embedding's extra rows never win).
    """
    from transformers import LogitsProcessorList

    if batch_size < 1:
        raise EvalError(f"batch_size must be >= 1, got {batch_size}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None:
        raise EvalError("tokenizer has no eos_token; generation could not stop")
    pad = eos if pad is None else pad
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    out: list[list[int]] = [[] for _ in encoded]
    dev = input_device(model)
    cut = LogitsProcessorList([VocabCut(len(tokenizer))])
    starts = range(0, len(order), batch_size)
    for start in progress(starts, desc="evaluate", total=len(starts), unit="batch"):
        idx = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)  # (B, T) left-padded
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(encoded[i])
            ids[r, width - n :] = torch.tensor(encoded[i])
            mask[r, width - n :] = 1
        gen = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
            logits_processor=cut,
        )
        new = gen[:, width:].tolist()  # (B, <= max_new_tokens)
        for r, i in enumerate(idx):
            toks = new[r]
            out[i] = toks[: toks.index(eos) + 1] if eos in toks else toks
    return out


def evaluate_model(
    model,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    fmt: Format,
    batch_size: int = 64,
    max_new_tokens: int = 96,
) -> ModelEval:
    """Greedy accuracy of ``model`` alone on ``rows`` (graded by ``citer.data.answers.grade``)."""
    if not rows:
        raise EvalError("evaluate_model: no rows to evaluate")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        tokens = generate_greedy(
            model, tokenizer, [build_prompt(r, fmt) for r in rows], batch_size, max_new_tokens
        )
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    preds = []
    for i, (row, toks) in enumerate(zip(rows, tokens, strict=True)):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        preds.append(
            Prediction(
                index=i,
                id=str(row["id"]) if "id" in row else None,
                text=text,
                extracted=extract_answer(text, fmt, row.get("choices") if fmt == "mc" else None),
                correct=grade(text, row, fmt),
                n_tokens=len(toks),
            )
        )
    n_correct = sum(p.correct for p in preds)
    return ModelEval(
        accuracy=n_correct / len(preds),
        n=len(preds),
        n_correct=n_correct,
        seconds=seconds,
        tokens_generated=sum(p.n_tokens for p in preds),
        predictions=preds,
    )


def write_models_report(
    path: str | os.PathLike[str],
    slm_params: int,
    slm_acc: float,
    llm_params: int,
    llm_acc: float,
    seconds: float,
) -> dict[str, Any]:
    """``reports/models.json``: the pair's sizes and test accuracies (key names are read by other stages). The
    ``seconds`` it took to build the pair are a fact of this run, kept in ``reports/provenance.json``'s
    ``run_facts`` (:func:`citer.tracking.provenance.write_results`); the full record is returned."""
    report = {
        "slm": {"params": int(slm_params), "test_accuracy": float(slm_acc)},
        "llm": {"params": int(llm_params), "test_accuracy": float(llm_acc)},
        "seconds": float(seconds),
    }
    write_results(path, report, stage="eval_models")
    return report
