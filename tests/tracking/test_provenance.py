"""reports/provenance.json: which run wrote each report, and whether the file is still what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import time

from citer.tracking import provenance


def test_stamp_records_the_run_and_notices_a_later_edit(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "a.json").write_text('{"x": 1}')
    (reports / "b.json").write_text("[1, 2]")
    keys = provenance.stamp(reports, [reports / "a.json"], stage="sweep", root=tmp_path, wall_s=12.345,
                            params={"sweep": {"seed": 0}})  # fmt: skip
    assert keys == ["reports/a.json"]
    entry = provenance.read(reports)["files"]["reports/a.json"]
    assert entry["stage"] == "sweep" and entry["stage_wall_s"] == 12.35
    assert entry["params_digest"] == provenance.params_digest({"sweep": {"seed": 0}})
    assert entry["params_digest"] != provenance.params_digest({"sweep": {"seed": 1}})
    assert entry["machine"]["cores"] == os.cpu_count() and entry["machine"]["device"] == "cpu"
    assert entry["commit"] == "unknown"  # not a git checkout
    assert provenance.mismatches(reports, tmp_path) == {"reports/b.json": "no provenance entry"}
    (reports / "a.json").write_text('{"x": 2}')
    assert provenance.mismatches(reports, tmp_path)["reports/a.json"].startswith(
        "changed since sweep wrote it"
    )


def test_stamp_written_leaves_inner_stages_their_entries(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "old.json").write_text("{}")
    past = time.time() - 100
    os.utime(reports / "old.json", (past, past))
    outer = time.time() - 1
    (reports / "inner.json").write_text("{}")
    provenance.stamp_written(reports, outer, stage="labels", root=tmp_path, wall_s=1.0)
    (reports / "outer.json").write_text("{}")
    provenance.stamp_written(reports, outer, stage="pipeline", root=tmp_path, wall_s=9.0)
    files = provenance.read(reports)["files"]
    assert files["reports/inner.json"]["stage"] == "labels"  # stamped inside the pipeline: kept
    assert files["reports/outer.json"]["stage"] == "pipeline"
    assert "reports/old.json" not in files  # written before this run: not this run's


def test_git_head(tmp_path):
    assert provenance.git_head(tmp_path) == "unknown"
    run = {"cwd": tmp_path, "check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q"], **run)
    (tmp_path / "f").write_text("x")
    subprocess.run(["git", "add", "f"], **run)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"], **run)
    head = subprocess.run(["git", "rev-parse", "HEAD"], text=True, **run).stdout.strip()
    assert provenance.git_head(tmp_path) == head and len(head) == 40


def test_git_head_says_dirty_when_asked(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    head = provenance.git_head(tmp_path)
    assert len(head) == 40 and provenance.git_head(tmp_path, dirty=True) == head
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "r.json").write_text("1")
    git("add", "reports/r.json")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "y")
    head = provenance.git_head(tmp_path)
    (tmp_path / "reports" / "r.json").write_text("2")  # a run rewriting its own tracked report: still clean
    assert provenance.git_head(tmp_path, dirty=True) == head
    (tmp_path / "f").write_text("2")
    assert provenance.git_head(tmp_path, dirty=True) == f"{head}+dirty"


def test_bench_stamp_keeps_its_arguments(tmp_path):
    out = tmp_path / "reports" / "bench_x.json"
    out.parent.mkdir()
    out.write_text(json.dumps([{"a": 1}]))
    provenance.stamp_bench(out, "engine", {"quick": True, "out": out}, 3.0)
    entry = provenance.read(out.parent)["files"]["reports/bench_x.json"]
    assert entry["stage"] == "bench:engine" and entry["params_digest"] is None
    assert entry["args"] == {"quick": True, "out": "reports/bench_x.json"}  # relative to the project


def test_a_stage_without_reports_still_records_its_run(tmp_path):
    reports = tmp_path / "reports"
    provenance.stamp_written(reports, time.time(), stage="pipeline", root=tmp_path, wall_s=421.0)
    run = provenance.read(reports)["runs"]["pipeline"]
    assert run["wall_s"] == 421.0 and run["machine"]["cores"] == os.cpu_count()
    assert provenance.read(reports)["files"] == {}
