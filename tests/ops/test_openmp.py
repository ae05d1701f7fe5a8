"""citer.ops.openmp: the wait policy is set unless the environment names one, and the ``citer`` console and every speed
bench have it in place when torch (and with it libgomp) is first imported, so what a bench times is what ``citer
route`` runs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from citer.ops import openmp

# Prints the wait-policy variables at the moment torch is first imported, then runs the code after it.
HOOK = """
import importlib.abc, json, os, sys
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("AT_TORCH", json.dumps({k: os.environ[k] for k in %r if k in os.environ}), flush=True)
        return None
sys.meta_path.insert(0, Hook())
"""
CONSOLE = """
import citer.cli as cli
def app():
    import torch
    return 0
cli.app = app
sys.argv = ["citer"]
cli.main()
"""
BENCHES = ["slm_step", "roofline", "cpu_linear", "llama_cpp_routed", "speed"]


@functools.cache
def at_torch_import(code: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in openmp.WAIT_KEYS} | extra
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-c", HOOK % (openmp.WAIT_KEYS,) + code], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [x for x in res.stdout.splitlines() if x.startswith("AT_TORCH ")]
    assert lines, f"torch was never imported (rc {res.returncode}): {res.stderr[-2000:]}"
    return json.loads(lines[0].removeprefix("AT_TORCH "))


def test_the_policy_is_set_unless_the_environment_names_one():
    env: dict[str, str] = {}
    assert openmp.set_wait_env(env) == openmp.WAIT_ENV == env
    for named in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(named)
        assert openmp.set_wait_env(env) == named == env


def test_a_peer_runs_without_the_policy_this_process_added(monkeypatch):
    monkeypatch.setattr(openmp, "_ADDED", dict(openmp.WAIT_ENV))
    for k in openmp.WAIT_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in openmp.WAIT_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    peer = openmp.peer_environ()
    assert openmp.wait_env(peer) == {} and peer["OMP_NUM_THREADS"] == "2"


def test_the_console_sets_the_policy_before_torch_loads():
    assert at_torch_import(CONSOLE) == openmp.WAIT_ENV
    assert at_torch_import(CONSOLE, OMP_WAIT_POLICY="PASSIVE") == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("bench", BENCHES)
def test_each_speed_bench_waits_as_the_console_does(bench):
    code = f"import runpy; runpy.run_path({str(REPO / 'bench' / f'{bench}.py')!r}, run_name='imported')"
    assert at_torch_import(code) == at_torch_import(CONSOLE) == openmp.WAIT_ENV
