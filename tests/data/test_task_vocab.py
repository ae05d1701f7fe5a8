"""Questions outside the embedded task are named: words it never uses, numbers above its range."""

from __future__ import annotations

import json

from citer.config import SynthParams
from citer.data.synth import synthesize
from citer.data.task_vocab import outside_task, questions_outside_task


def test_every_synthesised_question_is_inside_and_others_are_named(tmp_path):
    p = SynthParams(seed=3, n_train=300, n_dev=10, n_test=10)
    rows = synthesize(p)
    top = max(p.max_total, p.max_start)
    assert all(outside_task(r["problem"], top) == [] for r in rows["math_train"])
    assert all(outside_task(r["question"], top) == [] for r in rows["mc_test"])
    assert outside_task("Jane has 3 oranges and finds 250. How many oranges now?", top) == [
        "250",
        "Jane",
        "oranges",
    ]
    f = tmp_path / "q.jsonl"
    lines = [rows["math_test"][0], {"problem": "What is 12 squared?"}, {"solution": "no question"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines) + "not json\n")
    assert questions_outside_task(f, "math", top) == (1, 2, ["What", "is", "squared"])
