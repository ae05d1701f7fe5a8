"""Rows cut at finetune.max_length: counted and reported below finetune.max_truncated_fraction, refused above it."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from citer.config import FinetuneParams
from citer.data.jsonl import read_jsonl
from citer.models.finetune import FinetuneError, finetune_slm

SHORT = [{"problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. So \\boxed{{{i + 1}}}."} for i in range(8)]
LONG = {"problem": "what is " * 12 + "1 + 1?", "solution": "1 + 1 = 2. So \\boxed{2}."}  # > 64 characters
TINY = FinetuneParams(lr=3e-3, max_steps=2, batch_size=4, max_length=64, logging_steps=1, bf16=False)


def _file(tmp_path, rows):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_refuses_before_training_above_the_fraction(tiny_pair_dirs, tmp_path):
    # 3 of 10 rows (lines 2, 5, 9) do not fit 64 tokens: 30% > 5%.
    rows = SHORT[:1] + [LONG] + SHORT[1:3] + [LONG] + SHORT[3:6] + [LONG] + SHORT[6:7]
    path = _file(tmp_path, rows)
    out = tmp_path / "slm"
    with pytest.raises(FinetuneError) as err:
        finetune_slm(tiny_pair_dirs[0], read_jsonl(path, "math"), "math", TINY, out)
    msg = str(err.value)
    assert msg.startswith(f"{path}: 3 of 10 training rows (30.0%)")
    for part in ("finetune.max_length=64", "finetune.max_truncated_fraction=0.05", "lines 2, 5, 9"):
        assert part in msg, msg
    assert not out.exists()


def test_reports_the_count_below_the_fraction(tiny_pair_dirs, tmp_path):
    rows = SHORT + [LONG]  # 1 of 9 cut
    params = TINY.model_copy(update={"max_truncated_fraction": 0.2})
    res = finetune_slm(tiny_pair_dirs[0], rows, "math", params, tmp_path / "slm")
    assert res.truncated_examples == 1 and res.truncated_fraction == pytest.approx(1 / 9)
    assert res.metrics()["truncated_fraction"] == pytest.approx(1 / 9)
    assert res.train_examples == 8  # its prompt alone fills max_length: nothing of it is left to learn
    # Exactly at the limit passes; one more row cut does not.
    at_limit = TINY.model_copy(update={"max_truncated_fraction": 1 / 9})
    assert finetune_slm(tiny_pair_dirs[0], rows, "math", at_limit, tmp_path / "again").truncated_examples == 1
    with pytest.raises(FinetuneError, match=re.escape("rows: 2 of 10 training rows (20.0%)")):
        finetune_slm(
            tiny_pair_dirs[0],
            rows + [LONG],
            "math",
            params.model_copy(update={"max_truncated_fraction": 0.15}),
            tmp_path / "x",
        )


def test_flow_writes_the_count_to_the_report(prefect_server, project, tiny_pair_dirs):
    from flows.finetune_slm import finetune_flow

    train = _file(project, SHORT + [LONG])
    params = {
        "data": {"format": "math", "train": str(train), "dev": str(train), "test": str(train)},
        "models": {
            "slm": str(tiny_pair_dirs[0]),
            "llm": str(tiny_pair_dirs[1]),
            "finetuned_slm": "models/slm",
        },
        "bootstrap": {"enabled": False},
        "finetune": TINY.model_dump() | {"max_truncated_fraction": 0.2, "eval_examples": 2},
        "eval": {"max_new_tokens": 4, "batch_size": 2},
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    summary = finetune_flow("params.yaml")
    report = json.loads((project / "reports" / "finetune.json").read_text(encoding="utf-8"))
    assert report["truncated_examples"] == summary["truncated_examples"] == 1
    assert report["truncated_fraction"] == pytest.approx(1 / 9)
