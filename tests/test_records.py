"""CI's stale-records check (scripts/check_records.py): the committed dvc.lock and reports come from the committed
code, params and data; an edit to any code a stage runs names that stage, with the command that reruns it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("check_records", REPO / "scripts" / "check_records.py")
records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(records)


@pytest.fixture()
def checkout(tmp_path):
    """A clean checkout of the working tree's files git keeps (no models, data or label sets: a fresh clone)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    root = tmp_path / "proj"
    for f in files.stdout.split():
        if f.startswith("tests/") or not (REPO / f).is_file():
            continue
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "clean"]):
        subprocess.run(
            ["git", *cmd], cwd=root, check=True, capture_output=True, env={**env, "PATH": "/usr/bin:/bin"}
        )
    return root


def check(root):
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "check_records.py"), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_committed_records_are_the_committed_codes(checkout):
    """What CI runs first: a stale lock fails here too, naming the stage to rerun."""
    res = check(checkout)
    assert res.returncode == 0, res.stderr
    assert "come from this code" in res.stdout


def test_an_edited_helper_a_stage_imports_names_that_stage(checkout):
    # citer/data/origin.py is no stage's entry point: synth reaches it through citer.data.jsonl
    helper = checkout / "citer" / "data" / "origin.py"
    helper.write_text(helper.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    stale = records.stale_stages(checkout)
    assert {"synth", "validate", "sweep"} <= set(stale), stale
    assert "citer/data/origin.py modified" in stale["synth"]
    res = check(checkout)
    assert res.returncode == 1
    assert "stale records: stage synth (citer/data/origin.py modified): run `dvc repro synth`" in res.stderr


def test_a_changed_param_or_an_edited_report_is_stale_but_a_missing_output_is_not(checkout):
    assert not (checkout / "models").exists()  # outputs a clean checkout lacks do not count
    report = checkout / "reports" / "models.json"
    report.write_text(report.read_text(encoding="utf-8").replace("0.", "0.0", 1), encoding="utf-8")
    params = checkout / "params.yaml"
    params.write_text(
        params.read_text(encoding="utf-8").replace("n_train: 6000", "n_train: 6001", 1), encoding="utf-8"
    )
    stale = records.stale_stages(checkout)
    assert "reports/models.json modified" in stale["eval_models"], stale
    assert "param synth modified" in stale["synth"], stale
