"""The fault matrix's harness (``tests/faults/test_faults.py``): ``citer`` commands run as subprocesses in copies of the base
project, what each finished command said, and one entry of the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BIN = Path(sys.executable).parent
MODEL, ALIAS = "citer-router", "champion"
SMALL, BIG = "data/faults_small.jsonl", "data/faults_route.jsonl"  # route inputs: a check, a longer run
N_BIG = 40


@dataclass
class Cmd:
    """One finished ``citer`` command."""

    args: list[str]
    rc: int | None
    out: str
    err: str
    seconds: float
    killed: str | None = None  # "fault" (SIGKILL on purpose) or "timeout"

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]

    def one_line_error(self, *needles: str) -> bool:
        """Exit 1, exactly one ``error:`` line containing every needle, no traceback."""
        lines = self.error_lines
        return (
            self.rc == 1
            and len(lines) == 1
            and "Traceback" not in self.err
            and all(n.lower() in lines[0].lower() for n in needles)
        )

    def json(self) -> dict[str, Any]:
        """The JSON a command printed (its summary), or {}."""
        lines = self.out.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    return json.loads("\n".join(lines[i:]))
        return {}

    def brief(self) -> dict[str, Any]:
        err = [line for line in self.err.splitlines() if line.strip() and "Warning" not in line]
        out: dict[str, Any] = {
            "cmd": "citer " + " ".join(self.args),
            "rc": self.rc,
            "seconds": round(self.seconds, 1),
        }
        if self.killed:
            out["killed"] = self.killed
        if err:
            out["stderr"] = [line[:400] for line in err[-3:]]
        return out


def citer_env(api_url: str | None) -> dict[str, str]:
    """The environment of a ``citer`` subprocess: this venv, offline, no inherited tool state."""
    env = dict(os.environ)
    for key in ("MLFLOW_TRACKING_URI", "CITER_ROOT", "CITER_PARENT_RUN_ID", "CITER_DEBUG", "PREFECT_API_URL"):
        env.pop(key, None)
    for key in ("PREFECT_HOME", "PREFECT_LOGGING_LEVEL"):  # the command's own defaults (state in the project)
        env.pop(key, None)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        CITER_PROGRESS="0",
        CITER_JSON="1",  # each command's whole result as JSON on stdout: Cmd.json reads it
        MLFLOW_DISABLE_TELEMETRY="true",
        DVC_NO_ANALYTICS="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # One thread per command: tiny models, and two commands at once on 2 cores oversubscribe badly otherwise.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


class Proc:
    """A running ``citer`` command (its own session, so a timeout can stop its whole group)."""

    def __init__(self, proj: Proj, args: list[str], api: bool) -> None:
        proj.n_cmds += 1
        base = proj.logs / f"{proj.n_cmds:02d}-{'_'.join(a.strip('-') for a in args[:2])}"
        self.args = args
        self.out_path, self.err_path = base.with_suffix(".out"), base.with_suffix(".err")
        self.t0 = time.monotonic()
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.popen = subprocess.Popen(
                [str(BIN / "citer"), *args],
                cwd=proj.root,
                env=citer_env(proj.api_url if api else None),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.killed: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> Cmd:
        try:
            self.popen.wait(timeout=max(0.1, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.killed = self.killed or "timeout"
            with contextlib.suppress(OSError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        return Cmd(
            self.args,
            self.popen.returncode,
            self.out_path.read_text(errors="replace"),
            self.err_path.read_text(errors="replace"),
            time.monotonic() - self.t0,
            self.killed,
        )


@dataclass
class Proj:
    """A copy of the finished project and the commands run in it."""

    root: Path
    api_url: str | None
    logs: Path
    n_cmds: int = 0
    cmds: list[Cmd] = field(default_factory=list)

    def start(self, *args: str, api: bool = True) -> Proc:
        return Proc(self, list(args), api)

    def finish(self, proc: Proc, timeout: float) -> Cmd:
        cmd = proc.wait(timeout)
        self.cmds.append(cmd)
        return cmd

    def run(self, *args: str, timeout: float = 240, api: bool = True) -> Cmd:
        return self.finish(self.start(*args, api=api), timeout)

    def set_param(self, key: str, value: Any) -> None:
        path = self.root / "params.yaml"
        params = yaml.safe_load(path.read_text())
        node = params
        *parents, last = key.split(".")
        for k in parents:
            node = node[k]
        node[last] = value
        path.write_text(yaml.safe_dump(params, sort_keys=False))

    def client(self) -> Any:
        import mlflow

        return mlflow.MlflowClient(tracking_uri=f"sqlite:///{self.root / 'mlflow.db'}")

    def drop_champion(self) -> None:
        """Start without a champion, the way citer's own message says (alias and its citer tag deleted)."""
        client = self.client()
        client.delete_registered_model_alias(MODEL, ALIAS)
        client.delete_registered_model_tag(MODEL, f"citer.alias.{ALIAS}")


@dataclass
class Ctx:
    """The finished base project and where the faults' copies of it go (one copy per fault)."""

    base: Path
    work: Path
    api_url: str | None

    def copy(self, name: str) -> Proj:
        root = self.work / name / "project"
        shutil.copytree(self.base, root, symlinks=True)
        shutil.rmtree(root / ".state" / "prefect", ignore_errors=True)  # the base's Prefect db is not needed
        logs = self.work / name / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return Proj(root, self.api_url, logs)


def entry(
    fault: str, kind: str, left: str, recovered: bool, ok: bool, t0: float, proj: Proj | None, **detail: Any
) -> dict[str, Any]:
    if proj is not None:
        detail["commands"] = [c.brief() for c in proj.cmds]
    return {
        "fault": fault,
        "kind": kind,
        "what_was_left": left,
        "recovered": bool(recovered),
        "ok": bool(ok),
        "seconds": round(time.monotonic() - t0, 1),
        "detail": detail,
    }
