"""bench/llama_cpp_routed.py at tiny shapes: every precision and pair timed, each ratio by its definition, recomputed
from the row's own measurements. Skips in one line without llama-cpp-python."""

from __future__ import annotations

import json

import pytest
from conftest import bench_module

from citer.decoding.llama_cpp_runner import missing

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def test_the_report_holds_its_ratios_by_their_definitions(tmp_path):
    bench = bench_module("llama_cpp_routed")
    out = tmp_path / "r.json"
    args = ["--pair", "tiny-llama", "--quants", "Q8_0", "--batches", "1,2", "--prompt-len", "8", "--new-tokens", "6",
            "--f", "0.5", "--reps", "1", "--scratch", str(tmp_path / "gguf"), "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    rep = json.loads(out.read_text())
    rows = rep["rows"]
    # per batch: both precisions alone and routed, then the faster SLM with the other LLM
    assert [(r["batch"], r["slm_precision"], r["llm_precision"]) for r in rows][:2] == [(1, "bf16", "bf16"),
                                                                                      (1, "q8_0", "q8_0")]  # fmt: skip
    assert len(rows) == 6 and {r["batch"] for r in rows} == {1, 2}
    for r in rows:
        assert r["routed_llm_tokens_read"] >= r["batch"] * 8  # half the tokens routed: every prompt read
        floor = r["slm_only_s"] + r["routed_llm_tokens_read"] / r["llm_prompt_tok_s"]
        assert r["ceiling_over_own_llm"] == pytest.approx(r["llm_only_s"] / floor)
        assert r["routed_over_own_llm"] == pytest.approx(r["llm_only_s"] / r["routed_s"])
        assert r["routed_over_ideal"] == pytest.approx(r["routed_s"] / (r["slm_only_s"] + r["routed_llm_s"]))
    # batch > 1 also runs the params' shared calls, their tokens' agreement with calling at once beside
    assert all(("routed_shared_tok_s" in r) == (r["batch"] > 1) for r in rows)
    assert all(0.0 < r["routed_shared_agreement"] <= 1.0 for r in rows if r["batch"] > 1)
    assert (
        "FixedRule" in rep["settings"]["shared_call_rule"]
        or "MeasuredRule" in rep["settings"]["shared_call_rule"]
    )
    for b in (1, 2):
        at = [r for r in rows if r["batch"] == b]
        best = max(r["llm_only_tok_s"] for r in at)
        top = max(max(r["routed_tok_s"], r.get("routed_shared_tok_s", 0.0)) for r in at)
        assert rep["ratios"][f"b{b}_best_routed_over_best_llm_only"] == pytest.approx(top / best)
        assert rep["ratios"][f"b{b}_ceiling_over_best_llm_only"] == pytest.approx(bench.ceiling_over_best(at))
    assert rep["device"]["vector"] and rep["files"]["q8_0"]["llm"]["tensor_types"].get("Q8_0")
