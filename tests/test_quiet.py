"""The console stays quiet: library notes a user cannot act on are dropped, every other warning still shows."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

_CODE = """
import logging, sys, warnings
from flows.common import quiet_defaults
quiet_defaults()
if sys.argv[1] == "captured":
    logging.captureWarnings(True)  # as Prefect does inside a flow
    logging.basicConfig()
import citer.routing.pyfunc  # MLflow warns about the untyped predict when the class is defined
warnings.warn("a warning a user should see")
"""


def test_mlflow_type_hint_note_is_dropped_and_other_warnings_show():
    for mode in ("plain", "captured"):
        out = subprocess.run([sys.executable, "-c", _CODE, mode], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert "Add type hints" not in out.stderr, mode
        assert "a warning a user should see" in out.stderr, mode


def test_a_command_boots_prefects_server_only_without_an_api_url():
    """A stage command boots the temporary server early (while it imports); with a server named (a real one, a test
    harness) there is nothing to boot and nothing is started."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from citer.cli import prefect_server

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        ready = prefect_server.boot()
        assert "proc" not in prefect_server._STATE and "url" not in prefect_server._STATE
        assert ready(["no_such_module_is_imported"]) is None
