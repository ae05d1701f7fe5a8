"""The label store: parquet + safetensors on disk, read back whole, and Great Expectations on the label set."""

from __future__ import annotations

import json

import pytest
import torch

from citer.config import LabelsParams
from citer.routing.label_store import LabelsError, LabelSet, load_labels, save_labels, validate_labels
from citer.routing.labels import collect_iter1


def test_storage_roundtrip_and_ge_rejections(tiny_pair, tmp_path):
    slm, llm, tok = tiny_pair
    rows = [{"problem": "1+1", "solution": "\\boxed{2}"}, {"problem": "2+1", "solution": "\\boxed{3}"}]
    ls = collect_iter1(slm, llm, tok, rows, "math", LabelsParams(citer_s=True), slm_name="s", llm_name="l")
    out = save_labels(ls, tmp_path / "iter1")
    assert sorted(p.name for p in out.iterdir()) == ["hidden.safetensors", "meta.json", "tokens.parquet"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["hidden_size"] == 32 and meta["slm"] == "s" and meta["llm"] == "l" and meta["fmt"] == "math"
    assert sum(meta["case_counts"].values()) == ls.n_tokens
    back = load_labels(out, expected_hidden_size=32)
    assert torch.equal(back.hidden, ls.hidden)
    assert back.tokens.equals(ls.tokens) and back.meta["rows_hash"] == ls.meta["rows_hash"]
    with pytest.raises(LabelsError, match="hidden size is 64"):
        load_labels(out, expected_hidden_size=64)
    (out / "tokens.parquet").unlink()
    with pytest.raises(LabelsError, match="tokens.parquet: missing"):
        load_labels(out)

    rep = validate_labels(ls, 32)
    assert rep["success"] and rep["case_counts"] == ls.case_counts()
    bad = LabelSet(ls.hidden.clone(), ls.tokens.copy(), dict(ls.meta))
    bad.tokens.loc[1, "label"] = 2
    bad.tokens.loc[2, "case"] = "maybe"
    bad.hidden[4, 0] = float("nan")
    rep = validate_labels(bad, 32, raise_on_failure=False)
    failed = {(f["column"], tuple(f["first_rows"])) for f in rep["failures"]}
    assert {("label", (1,)), ("case", (2,)), ("hidden_finite", (4,))} <= failed
    with pytest.raises(LabelsError, match="validation failed"):
        validate_labels(bad, 32)
    with pytest.raises(LabelsError, match="hidden_size_matches_slm"):
        validate_labels(ls, 64)
    empty = LabelSet(ls.hidden[:0], ls.tokens.iloc[:0], {})
    with pytest.raises(LabelsError, match="not_empty"):
        validate_labels(empty, 32)
    with pytest.raises(LabelsError, match="empty label set"):
        save_labels(empty, tmp_path / "empty")
    assert not (tmp_path / "empty").exists()
