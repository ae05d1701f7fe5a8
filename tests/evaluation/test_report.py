"""The sweep's files: sweep.json with exactly its keys, details, plot data, the PNG; reading them back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import sweep_row as R

from citer.evaluation.report import (
    plot_pareto,
    read_sweep,
    sweep_metrics,
    write_pareto_json,
    write_plot_data,
    write_sweep,
    write_sweep_reports,
)
from citer.evaluation.sweep_rows import METHODS, SWEEP_KEYS, SweepError


def test_write_and_plot(sweep_rows, tmp_path):
    sweep_rows.append(R("champion", 0.5, 0.7, 0.3))
    write_sweep(tmp_path / "sweep.json", sweep_rows, tmp_path / "details.json")
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert all(list(r) == list(SWEEP_KEYS) for r in out)
    assert {r["method"] for r in out} <= set(METHODS) and len(out) == len(sweep_rows) - 1
    back = read_sweep(tmp_path / "details.json")
    # every field comes back but the wall-clock one, which the files leave to provenance's run_facts
    assert '"sec_per_token"' not in (tmp_path / "details.json").read_text()
    assert [replace(r, sec_per_token=0.0) for r in back] == [
        replace(r, sec_per_token=0.0) for r in sweep_rows
    ]
    write_plot_data(tmp_path / "pareto", sweep_rows)
    citer_csv = (tmp_path / "pareto" / "citer.csv").read_text().splitlines()
    assert (
        citer_csv[0] == "method,tau,bytes_moved_rel_llm,accuracy,llm_token_fraction" and len(citer_csv) == 5
    )
    write_pareto_json(tmp_path / "pareto.json", sweep_rows)
    pts = json.loads((tmp_path / "pareto.json").read_text())
    assert len(pts) == len(sweep_rows) - 1 and pts[0]["method"] == "citer"
    assert set(pts[0]) == {"method", "tau", "bytes_moved_rel_llm", "accuracy", "llm_token_fraction"}
    png = plot_pareto(sweep_rows, tmp_path / "plots" / "pareto.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["pareto.png"]  # no temporary left behind


def test_read_sweep_names_bad_row(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps([{"method": "citer", "tau": 0.5}]))
    with pytest.raises(SweepError, match=r"s.json: row 0: .*missing"):
        read_sweep(p)


def test_write_sweep_reports_writes_every_file_and_the_claims(sweep_rows, tmp_path):
    from citer.config import SweepParams
    from citer.evaluation.sweep import SweepResult

    result = SweepResult(dev=sweep_rows, test=sweep_rows, thresholds={"citer": [(0.1, 0.6)]}, quantiles={},
                         chosen={"citer": sweep_rows[4]})  # fmt: skip
    found = write_sweep_reports(tmp_path / "reports", result, SweepParams(intervals={"resamples": 100}))
    names = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert names == [
        "pareto",
        "pareto.json",
        "pareto.png",
        "sweep.json",
        "sweep_claims.json",
        "sweep_details.json",
        "sweep_dev.json",
    ]
    assert found["protocol"]["selected_on"] == "dev"
    assert found["protocol"]["methods"]["citer"]["chosen_on_dev"]["tau"] == 0.6
    assert json.loads((tmp_path / "reports" / "sweep_claims.json").read_text()) == json.loads(
        json.dumps(found)
    )
    assert found["citer_bytes_rel_at_target"] == 0.35 and found["llm_accuracy"] == 0.80
    metrics = sweep_metrics(sweep_rows, found)
    assert metrics["citer.tau_0.6.accuracy"] == 0.79 and metrics["llm.bytes_rel_llm"] == 1.0
    assert metrics["claims.citer_bytes_rel_at_target"] == 0.35
    assert not any(k.startswith("claims.dominance") for k in metrics)  # dicts are not metrics
    assert all(isinstance(v, float | int) and not isinstance(v, bool) for v in metrics.values())
