"""bench/roofline.py at tiny shapes: its engines are ``citer route``'s (the params' engine block through
``route_engine``), and its ceiling is the one its docstring defines, recomputed from the row's own measurements."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, bench_module

from citer.config import load_params


@pytest.fixture(scope="module")
def roofline():
    return bench_module("roofline")


def _params(tmp_path, **engine):
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    raw["engine"] = {**raw["engine"], **engine}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_the_bench_builds_its_engines_as_citer_route_does(roofline, tmp_path):
    """A changed engine block reaches every engine the bench times, exactly as ``route_engine`` (what ``citer route``
    and ``citer serve`` call) builds it from the same block."""
    from speed_report import build_pair

    from citer.decoding.baselines import RandomRouter
    from citer.serving.champion import route_engine

    path = _params(tmp_path, llm_min_rows=3, llm_max_wait_steps=2)
    block = roofline.engine_block(path)
    assert block == load_params(path).engine
    pair = build_pair("tiny", "cpu", "fp32")
    built = roofline.engines(pair, 0.2, block)
    route = route_engine(pair.slm, pair.llm, RandomRouter(0.2, seed=0), 0.5, block, vocab_size=pair.vocab)
    keys = ("llm_min_rows", "llm_max_wait_steps", "llm_schedule", "llm_prefill", "overlap", "forward", "tau",
            "vocab_size")  # fmt: skip
    for eng in built.values():
        assert (eng.llm_min_rows, eng.llm_max_wait_steps) == (3, 2)
    assert {k: getattr(built["routed"], k) for k in keys} == {k: getattr(route, k) for k in keys}


def test_the_report_holds_its_ceiling_by_its_definition(roofline, tmp_path):
    out = tmp_path / "roofline.json"
    args = ["--pair", "tiny", "--dtype", "fp32", "--batches", "1,2", "--prompt-len", "8", "--new-tokens", "6",
            "--fraction", "0.5", "--reps", "1", "--out", str(out),
            "--variants", "llm_prefill=admit;llm_schedule=measured,llm_min_rows=2"]  # fmt: skip
    assert roofline.main(args) == 0
    rep = json.loads(out.read_text())
    assert [r["batch"] for r in rep["rows"]] == [1, 2] and rep["engine"] == load_params(
        REPO / "params.yaml"
    ).engine.model_dump()
    for r in rep["rows"]:
        rate = r["batch"] * 8 / r["llm_prefill_s"]
        read = (r["routed_llm_prompt_tokens"] + r["routed_llm_catchup_tokens"]) / rate
        assert r["routed_llm_prompt_tokens"] > 0  # half the tokens go to the LLM: every row's prompt is read
        assert r["ceiling"] == pytest.approx(r["llm_s"] / (r["slm_s"] + read))
        passes = (r["routed_llm_calls"] - 1) * r["llm_row_step_s"]
        assert r["routed_llm_calls"] > 0 and r["llm_row_step_s"] > 0
        assert r["ceiling_at_calls"] == pytest.approx(r["llm_s"] / (r["slm_s"] + read + passes))
        assert r["measured"] == pytest.approx(r["llm_s"] / r["routed_s"])
        v = r["variants"]
        assert list(v) == ["llm_prefill=admit", "llm_schedule=measured,llm_min_rows=2"]
        assert all(x["measured"] == pytest.approx(r["llm_s"] / x["routed_s"]) for x in v.values())
        assert all(x["same_rows"] == 1.0 for x in v.values())  # float32: the same tokens, other schedules
