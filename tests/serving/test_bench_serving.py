"""``bench/serving.py`` end to end at a small size: real servers, a real load generator, a report whose rows add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serving_quick_writes_report(tmp_path):
    out = tmp_path / "bench_serving.json"
    cmd = [sys.executable, str(REPO / "bench" / "serving.py"), "--quick", "--clients", "1,3", "--rounds", "2"]
    subprocess.run([*cmd, "--out", str(out)], check=True, timeout=600, capture_output=True)
    rep = json.loads(out.read_text())
    servers = {"continuous", "continuous_shared", "one_at_a_time", "llm_only", "continuous_verified"}
    assert {(r["server"], r["clients"]) for r in rep["rows"]} == {(s, c) for s in servers for c in (1, 3)}
    for r in rep["rows"]:
        # Quick: 8 // clients requests per client, none lost and, routed, each equal to the request served alone.
        assert (
            r["requests"] == r["clients"] * (8 // r["clients"])
            and r["lost"] == 0
            and r["differ_from_alone"] == 0
        )
        assert 0 < r["completion_tokens"] <= r["requests"] * rep["max_tokens"]
        assert 0 < r["p50_ttft_s"] <= r["p50_latency_s"] and 0 < r["ttft_over_latency"] <= 1
        assert len(r["rounds"]) == 2 and r["tokens_per_s"] == max(x["tokens_per_s"] for x in r["rounds"])
    assert rep["ratios"]["continuous_verified_ttft_vs_continuous_at_1"] > 0  # the latency verification adds
    by = {(r["server"], r["clients"]): r["tokens_per_s"] for r in rep["rows"]}
    assert rep["ratios"]["continuous_vs_one_at_a_time_at_3"] == pytest.approx(
        by["continuous", 3] / by["one_at_a_time", 3]
    )
