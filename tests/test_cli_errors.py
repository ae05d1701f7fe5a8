"""Errors reach the user as one line and a non-zero exit; ``--debug``/``CITER_DEBUG`` add the traceback.

The subprocess tests run the real console script against the session's Prefect server, because the noise they
guard against (Prefect's failed-run tracebacks, tool INFO logs) goes to the process's real stderr, which an
in-process runner does not capture.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from citer.cli import _one_line

CITER = str(Path(sys.executable).parent / "citer")


def _run(args, cwd, **env):
    from prefect.settings import PREFECT_API_URL

    full = {k: v for k, v in os.environ.items() if not k.startswith(("CITER_", "PREFECT_LOGGING"))}
    full.update({"PREFECT_API_URL": PREFECT_API_URL.value() or "", "CITER_ROOT": str(cwd), **env})
    return subprocess.run([CITER, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def ten_rows(project):
    rows = [{"problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. \\boxed{{{i + 1}}}"} for i in range(10)]
    f = project / "ten.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (project / "params.yaml").write_text(
        "data: {format: math, train: ten.jsonl, dev: ten.jsonl, test: ten.jsonl}\n"
    )
    return f


def test_error_inside_a_flow_is_one_line(prefect_server, project, ten_rows):
    res = _run(["eval", "model", "./no-such-model", "ten.jsonl"], project)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: "), res.stderr
    assert "no-such-model" in lines[0]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_prints_the_traceback(prefect_server, project, ten_rows, how):
    args = ["eval", "model", "./no-such-model", "ten.jsonl"]
    res = _run(["--debug", *args], project) if how == "flag" else _run(args, project, CITER_DEBUG="1")
    assert res.returncode == 1
    assert "Traceback (most recent call last)" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_stage_output_holds_no_tool_chatter(prefect_server, project, ten_rows):
    res = _run(["data", "validate"], project)
    assert res.returncode == 0, res.stderr
    for noise in ("great_expectations", "ephemeral docs site", "mlflow.store", "INFO", "\x1b["):
        assert noise not in res.stderr + res.stdout, (noise, res.stderr)


def test_one_line_messages():
    assert _one_line(ValueError("data.train: bad.jsonl:3: field problem is empty\nmore")) == (
        "data.train: bad.jsonl:3: field problem is empty"
    )
    assert _one_line(KeyError("models.slm")) == "models.slm"
    assert _one_line(RuntimeError("CUDA error: invalid device ordinal")) == (
        "RuntimeError: CUDA error: invalid device ordinal"
    )
    assert _one_line(AssertionError()) == "AssertionError"


def test_help_needs_no_heavy_import():
    code = "import sys, citer.cli; print(sorted(m for m in ('torch', 'prefect', 'mlflow', 'transformers', 'great_expectations') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
