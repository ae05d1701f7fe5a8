"""The embedded arithmetic task: determinism, correct arithmetic, valid formats, variety, atomic writing."""

from __future__ import annotations

import re

import pytest

from citer.config import SynthParams
from citer.data.answers import extract_answer, grade
from citer.data.formats import structural_problems
from citer.data.jsonl import read_jsonl, rule_problems
from citer.data.synth import CONNECTORS, SynthError, synthesize, write_splits

SMALL = {"n_train": 300, "n_dev": 40, "n_test": 60}
STEP = re.compile(r"(?:(?:Then|Now|Next) )?(\d+) ([+-]) (\d+) = (\d+)\.")


def _steps(text: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in STEP.findall(text)]


def test_same_seed_same_rows_other_seed_other_rows():
    a = synthesize(SynthParams(seed=3, **SMALL))
    b = synthesize(SynthParams(seed=3, **SMALL))
    c = synthesize(SynthParams(seed=4, **SMALL))
    assert a == b
    assert a["math_train"] != c["math_train"]
    assert sorted(a) == ["math_dev", "math_test", "math_train", "mc_dev", "mc_test", "mc_train"]
    assert [len(a[f"math_{s}"]) for s in ("train", "dev", "test")] == [300, 40, 60]


def test_chains_of_thought_compute_the_right_answer():
    p = SynthParams(seed=1, **SMALL)
    splits = synthesize(p)
    for row, mc in zip(splits["math_train"], splits["mc_train"], strict=True):
        nums = [int(x) for x in re.findall(r"\d+", row["problem"])]
        steps = _steps(row["solution"])
        assert p.min_steps <= len(steps) == len(nums) - 1 <= p.max_steps
        total = nums[0]
        for (a, op, b, c), operand in zip(steps, nums[1:], strict=True):
            # Each step applies the next operand to the running total (additions in either order).
            assert {a, b} == {total, operand} if op == "+" else (a, b) == (total, operand)
            assert c == (a + b if op == "+" else a - b)
            assert 0 <= c <= p.max_total
            total = c
        assert extract_answer(row["solution"], "math") == str(total)
        assert grade(" " + row["solution"], row, "math")
        # The mc twin: same question, the answer's label, distinct numeric choices, cot ends in the label.
        assert mc["question"] == row["problem"]
        assert mc["choices"]["text"][mc["choices"]["label"].index(mc["answerKey"])] == str(total)
        assert len(set(mc["choices"]["text"])) == p.n_choices
        assert mc["cot"].endswith(f" {mc['answerKey']}.")
        # Consecutive ascending choices: the cot finds the answer's place from the first one, then names it.
        first, place = int(mc["choices"]["text"][0]), mc["choices"]["label"].index(mc["answerKey"])
        assert mc["choices"]["text"] == [str(first + j) for j in range(p.n_choices)] and first >= 0
        assert _steps(mc["cot"]) == steps  # the same arithmetic as the math twin
        assert f" {total} - {first} = {place}, so {total} is ({mc['answerKey']}). " in mc["cot"]
        assert grade(" " + mc["cot"], mc, "mc")


def test_rows_pass_the_format_rules():
    splits = synthesize(SynthParams(seed=2, **SMALL))
    for name, rows in splits.items():
        fmt = name.split("_")[0]
        for row in rows:
            assert structural_problems(row, fmt) == []
            assert rule_problems(row, fmt) == []


def test_held_out_problems_are_not_train_problems():
    splits = synthesize(SynthParams(seed=0, **SMALL))
    train = {r["problem"] for r in splits["math_train"]}
    held = [r["problem"] for s in ("dev", "test") for r in splits[f"math_{s}"]]
    assert not train & set(held)
    assert len(set(held)) == len(held)


def test_variety_zero_is_canonical_and_variety_gives_alternatives():
    plain = synthesize(SynthParams(seed=0, variety=0.0, **SMALL))["math_train"]
    varied = synthesize(SynthParams(seed=0, variety=1.0, **SMALL))["math_train"]
    connectors = [c.strip() for c in CONNECTORS if c]

    def reversed_additions(rows):
        n = 0
        for r in rows:
            total = int(re.findall(r"\d+", r["problem"])[0])
            for a, op, _b, c in _steps(r["solution"]):
                n += op == "+" and a != total
                total = c
        return n

    assert not any(w in r["solution"] for r in plain for w in connectors)
    assert all(r["solution"].split(" \\boxed")[0].endswith("So the answer is") for r in plain)
    assert reversed_additions(plain) == 0
    assert all(any(w in r["solution"] for r in varied) for w in connectors)
    assert reversed_additions(varied) > 0
    assert {r["solution"].split(". ")[-1].split(" \\boxed")[0] for r in varied} >= {"The answer is"}


def test_write_splits_round_trips_through_the_reader(tmp_path):
    splits = synthesize(SynthParams(seed=0, **SMALL))
    paths = write_splits(tmp_path / "embedded", splits)
    assert sorted(p.name for p in (tmp_path / "embedded").iterdir()) == sorted(f"{k}.jsonl" for k in splits)
    for path in paths:
        fmt = path.name.split("_")[0]
        assert read_jsonl(path, fmt) == splits[path.stem]


def test_bad_params_and_empty_splits_fail_without_writing(tmp_path):
    # params.yaml refuses these when it is read; synthesize keeps its own check for callers that build params
    # without validation (model_construct).
    for bad, word in (
        ({"min_steps": 3, "max_steps": 2}, "min_steps"),
        ({"max_start": 30, "max_operand": 20, "max_total": 40}, "max_total"),
        ({"n_test": 0}, "n_test"),
    ):
        with pytest.raises(ValueError, match=word):
            SynthParams(**bad)
    with pytest.raises(SynthError, match="min_steps"):
        synthesize(
            SynthParams.model_construct(**(SynthParams().model_dump() | {"min_steps": 3, "max_steps": 2}))
        )
    with pytest.raises(SynthError, match="max_total"):
        synthesize(
            SynthParams.model_construct(
                **(SynthParams().model_dump() | {"max_start": 30, "max_operand": 20, "max_total": 40})
            )
        )
    with pytest.raises(SynthError, match="positive"):
        synthesize(SynthParams.model_construct(**(SynthParams().model_dump() | {"n_test": 0})))
    with pytest.raises(SynthError, match="distinct"):
        # One step on tiny numbers allows only 10 names x 8 items x 8 verbs = 640 distinct problems.
        synthesize(
            SynthParams(
                n_train=10,
                n_dev=10,
                n_test=2000,
                max_start=1,
                max_operand=1,
                max_total=2,
                min_steps=1,
                max_steps=1,
            )
        )
    with pytest.raises(SynthError, match="math_dev"):
        write_splits(
            tmp_path / "out", {"math_train": [{"problem": "p", "solution": "\\boxed{1}"}], "math_dev": []}
        )
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []
