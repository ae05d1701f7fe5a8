"""tests/conftest.py stops a CI session that lacks the shared benchmark files, and says locally why their tests skip."""

from __future__ import annotations

import conftest
import pytest


def test_ci_without_shared_data_stops_the_session(monkeypatch, tmp_path):
    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path / "missing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(
        pytest.UsageError, match="CI is set but the shared data is missing: .*missing is not a dir"
    ):
        conftest.pytest_configure(None)


def test_locally_missing_shared_data_is_one_header_line(monkeypatch, tmp_path):
    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path / "missing")
    for ci in ("", "false", "0"):
        monkeypatch.setenv("CI", ci)
        conftest.pytest_configure(None)  # no error: the tests that need the files skip
    header = conftest.pytest_report_header(None)
    assert header.startswith(f"shared data: not found at {tmp_path / 'missing'}") and "\n" not in header
    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path)
    monkeypatch.setenv("CI", "true")
    conftest.pytest_configure(None)
    assert conftest.pytest_report_header(None) is None
