"""The embedded task: short multi-step arithmetic word problems with a chain of thought.

Built so token-level routing has something to exploit:

- template tokens (connecting words, ``+``, ``=``, the closing phrase) are easy, even for a tiny model;
- computed tokens (the digits of each running total, the final answer, the mc answer letter) are hard: they are
  ~10-20 % of the chain of thought and are where a small model goes wrong;
- harmless variety (operand order of additions, the connecting word before a step, the closing phrase) is drawn at
  random per example with probability ``variety``, so at those positions several next tokens are valid and the
  reference picks one -- one-step labels call a different valid choice wrong, answer-checking labels do not.

math row: ``{"id", "problem", "solution"}`` with the solution ending in ``\\boxed{N}``.
mc row: ``{"id", "question", "choices": {"text", "label"}, "answerKey", "cot"}``: the same problems, four consecutive
numbers as choices (ascending, the answer at a random place); the cot computes the result, finds its place from the
first choice, names the choice, then states the label (``"... = 13. 13 - 11 = 2, so 13 is (C). So the answer is
C."``). The mc rows draw exactly what earlier versions drew, so the math rows do not depend on their form.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from citer.config import SynthParams
from citer.ops.io import atomic_dir, write_jsonl

NAMES = ["Ann", "Ben", "Cal", "Dan", "Eve", "Max", "Mia", "Sam", "Tom", "Zoe"]
ITEMS = ["apples", "books", "cards", "coins", "pens", "shells", "stamps", "eggs"]
ADD_VERBS = ["finds", "gets", "buys", "wins"]
SUB_VERBS = ["loses", "sells", "gives away", "uses"]
# The first entry is the canonical choice; the others are the harmless alternatives.
CONNECTORS = ["", "Then ", "Now ", "Next "]
CLOSINGS = ["So the answer is", "The answer is", "Thus the answer is"]
LABELS = "ABCDEFGH"
SPLITS = ("train", "dev", "test")


class SynthError(ValueError):
    """Parameters that cannot produce the requested problems."""


def _pick(rng: random.Random, options: list[str], variety: float) -> str:
    """The canonical option, or with probability ``variety`` a uniformly drawn one (possibly the canonical)."""
    return rng.choice(options) if rng.random() < variety else options[0]


def _problem(rng: random.Random, p: SynthParams) -> tuple[int, list[tuple[str, int]]]:
    """A start value and a list of (op, operand) whose running totals stay in [0, max_total]."""
    n_steps = rng.randint(p.min_steps, p.max_steps)
    while True:
        total = start = rng.randint(1, p.max_start)
        ops: list[tuple[str, int]] = []
        for _ in range(n_steps):
            b = rng.randint(1, p.max_operand)
            # Subtract only when the result stays non-negative; otherwise add (if it fits).
            op = "-" if (rng.random() < 0.5 and total - b >= 0) or total + b > p.max_total else "+"
            if op == "-" and total - b < 0:
                break
            total = total + b if op == "+" else total - b
            ops.append((op, b))
        if len(ops) == n_steps:
            return start, ops


def _texts(
    rng: random.Random, p: SynthParams, start: int, ops: list[tuple[str, int]]
) -> tuple[str, str, int]:
    """(problem text, chain-of-thought steps without the closing phrase, answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    clauses = [f"{rng.choice(ADD_VERBS if op == '+' else SUB_VERBS)} {b}" for op, b in ops]
    acts = ", ".join(clauses[:-1]) + f" and {clauses[-1]}" if len(clauses) > 1 else clauses[0]
    problem = f"{name} has {start} {item}, {acts}. How many {item} now?"

    total, steps = start, []
    for i, (op, b) in enumerate(ops):
        new = total + b if op == "+" else total - b
        # Addition commutes: the operand order is a harmless choice.
        lhs = f"{b} + {total}" if op == "+" and rng.random() < p.variety / 2 else f"{total} {op} {b}"
        conn = _pick(rng, CONNECTORS, p.variety) if i > 0 else ""
        steps.append(f"{conn}{lhs} = {new}.")
        total = new
    return problem, " ".join(steps), total


def _choices(rng: random.Random, answer: int, n: int, max_total: int) -> tuple[list[str], str, int]:
    """``n`` consecutive numbers holding the answer at a random place, ascending; returns (texts, answer label,
    first choice).

    The answer's place is the first choice's distance from it, so a chain of thought finds the label with one more
    subtraction (``13 - 11 = 2``: the third choice) instead of a lookup a tiny model cannot learn in minutes. The
    draws are the same as for the shuffled choices of earlier versions, so the math rows do not change.
    """
    pool = [answer + d for d in range(-6, 7) if d != 0 and 0 <= answer + d <= max_total + 6]
    values = [answer, *rng.sample(pool, n - 1)]
    rng.shuffle(values)
    place = min(values.index(answer), answer)  # choices stay non-negative
    first = answer - place
    return [str(first + j) for j in range(n)], LABELS[place], first


def _example(rng: random.Random, p: SynthParams, split: str, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    start, ops = _problem(rng, p)
    problem, steps, answer = _texts(rng, p, start, ops)
    closing = _pick(rng, CLOSINGS, p.variety)
    math_row = {
        "id": f"synth-{split}-{i:05d}",
        "problem": problem,
        "solution": f"{steps} {closing} \\boxed{{{answer}}}.",
    }
    texts, key, first = _choices(rng, answer, p.n_choices, p.max_total)
    mc_row = {
        "id": f"synth-{split}-{i:05d}",
        "question": problem,
        "choices": {"text": texts, "label": list(LABELS[: p.n_choices])},
        "answerKey": key,
        # The cot finds the choice holding its result (its distance from the first choice), names it, then states
        # the label.
        "cot": f"{steps} {answer} - {first} = {LABELS.index(key)}, so {answer} is ({key}). "
        f"{_pick(rng, CLOSINGS, p.variety)} {key}.",
    }
    return math_row, mc_row


def synthesize(params: SynthParams) -> dict[str, list[dict[str, Any]]]:
    """All six splits (``math_train`` ... ``mc_test``); the same seed gives the same rows.

    Test and dev problems never repeat a train problem text (duplicates are redrawn), so held-out accuracy measures
    arithmetic, not memory.
    """
    p = params
    if p.min_steps < 1 or p.max_steps < p.min_steps:
        raise SynthError(f"synth: need 1 <= min_steps <= max_steps, got {p.min_steps}..{p.max_steps}")
    if p.max_start < 1 or p.max_operand < 1 or p.max_total < p.max_start + p.max_operand:
        raise SynthError(
            f"synth: need max_start, max_operand >= 1 and max_total >= max_start + max_operand, got "
            f"max_start={p.max_start} max_operand={p.max_operand} max_total={p.max_total}"
        )
    sizes = {"train": p.n_train, "dev": p.n_dev, "test": p.n_test}
    if any(n <= 0 for n in sizes.values()):
        raise SynthError(f"synth: split sizes must be positive, got {sizes}")
    rng = random.Random(p.seed)
    out: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for split in SPLITS:
        math_rows, mc_rows = [], []
        tries = 0
        while len(math_rows) < sizes[split]:
            tries += 1
            if tries > 50 * sizes[split] + 1000:
                raise SynthError(
                    f"synth: cannot draw {sizes[split]} distinct {split} problems; widen the ranges"
                )
            m, c = _example(rng, p, split, len(math_rows))
            if split != "train" and m["problem"] in seen:
                continue
            seen.add(m["problem"])
            math_rows.append(m)
            mc_rows.append(c)
        out[f"math_{split}"], out[f"mc_{split}"] = math_rows, mc_rows
    return out


def split_paths(out_dir: str | os.PathLike[str]) -> list[Path]:
    """The files :func:`write_splits` writes for :func:`synthesize`'s six splits (``math_train.jsonl`` ...)."""
    return [Path(out_dir) / f"{fmt}_{split}.jsonl" for fmt in ("math", "mc") for split in SPLITS]


def write_splits(out_dir: str | os.PathLike[str], splits: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """Write ``{name}.jsonl`` per split into ``out_dir`` in one atomic directory swap; returns the final paths."""
    if not splits:
        raise SynthError(f"{out_dir}: no splits to write")
    dst = Path(out_dir)
    with atomic_dir(dst) as tmp:
        for name, rows in splits.items():
            if not rows:
                raise SynthError(f"{dst / (name + '.jsonl')}: split {name!r} is empty")
            write_jsonl(tmp / f"{name}.jsonl", rows)
    return [dst / f"{name}.jsonl" for name in splits]
