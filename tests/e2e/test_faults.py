"""The fault matrix (bench/faults.py) on a tiny finished project: every kill, concurrent run, bad param, corrupt or
tampered file and registry fault must end as expected (see the module docstring there for what each one checks).

Real ``citer`` subprocesses, real SIGKILLs, each project's own MLflow sqlite store, real reruns; one base project
built once and copied per fault, the commands against the session's Prefect server (one kill starts its own on
purpose). About 2.5 minutes on 2 idle cores.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
from conftest import REPO

KINDS = {"kill", "concurrent", "bad_params", "corrupt", "tampered", "registry"}


def load_faults():
    spec = importlib.util.spec_from_file_location("bench_faults", REPO / "bench" / "faults.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_fault_matrix(prefect_server, tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL

    monkeypatch.delenv("CITER_ROOT", raising=False)
    faults = load_faults()
    t0 = time.monotonic()
    report = faults.run_matrix(tmp_path, api_url=str(PREFECT_API_URL.value()), jobs=2)
    seconds = time.monotonic() - t0

    entries = report["faults"]
    assert {e["kind"] for e in entries} == KINDS, [(e["fault"], e["what_was_left"]) for e in entries]
    names = [e["fault"] for e in entries]
    assert len(names) == len(set(names)) == report["totals"]["faults"] >= 22, names
    written = json.loads((tmp_path / "base" / "project" / "reports" / "faults.json").read_text())
    assert written["totals"] == report["totals"]
    bad = [
        {k: e[k] for k in ("fault", "what_was_left", "recovered", "detail")}
        for e in entries
        if not (e["ok"] and e["recovered"])
    ]
    assert not bad, (
        f"{len(bad)} fault(s) did not hold ({seconds:.0f} s):\n"
        + json.dumps(bad, indent=1, default=str)[:8000]
    )
