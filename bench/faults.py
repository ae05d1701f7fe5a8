"""A fault report: what a killed, concurrent, misconfigured or tampered ``citer`` command leaves behind, and whether the
next command ends in a consistent state. ``python bench/faults.py [--out PATH] [--jobs N] [--workdir DIR] [--keep]``.

It builds one tiny finished project (the repository's tracked files without tests, shrunken params, one
``citer pipeline``), then copies it once per fault so faults never interfere, and runs the real ``citer`` command in
each copy as a subprocess, one torch thread each (``PREFECT_API_URL`` points at one Prefect server the script starts,
unless set already):

- kill: SIGKILL ``citer eval sweep`` early (while it starts its own temporary Prefect server: no ``PREFECT_API_URL``),
  then the next sweep 4 s after it took the project lock, then the next one right after the registry gains a version
  (one copy, started without a champion, so the last killed sweep meant to move the alias), then a sweep to the end;
  SIGKILL ``citer route`` while it writes and ``citer router iterate`` while it retrains, then each again (the route
  rerun is the first of the two concurrent routes below). Checked: no process of the killed command (the Prefect
  server included) outlives it by more than 5 s; the alias points at an existing version whose files load (``citer route`` works);
  ``reports/promotion.json`` parses and names an existing version; no ``.tmp`` leftovers under reports/, artifacts/,
  outputs/; no promotion pending; a route output has exactly one row per input; every router directory loads.
- concurrent: two sweeps, the second started 1 s after the first holds the lock (it waits, then compares against
  the champion the first made; the alias, sampled every 0.1 s, never points at a version that lost), the same with
  ``lock.wait: false`` (the second refuses in one line naming the lock; the first succeeds), two ``citer route`` into
  one output, the second started 0.5 s after the first holds the lock (exactly N rows, the second skips them all).
- bad_params: out-of-range values each give exit 1, one ``error:`` line naming the key, no traceback, no file changed.
- corrupt: a truncated router file (``citer eval sweep``) and a truncated labels parquet (``citer router train``):
  one-line error naming the file, nothing promoted, nothing changed.
- tampered: a changed router.json in the MLflow artifact store (``citer route --llm-fraction 0.3`` over the
  pipeline's finished predictions must load the router: it refuses, naming sha256, and leaves the predictions as they
  were); a line that writes a marker file added to the stored pyfunc code (the three routes of the kill and
  concurrent route faults run in that copy: none runs it).
- registry: a dangling alias (the champion's version deleted through MlflowClient: sweep and route stop in one line,
  nothing promoted; deleting the alias tag as the message says leaves a consistent project without a champion), and
  ``registry.min_eval_examples`` above ``sweep.n_examples`` with no champion (not promoted, the reason naming the key;
  the same copy and sweep as the ``lock.wait: false`` fault).

Each entry: ``fault``, ``kind``, ``what_was_left`` (the state found right after the fault), ``recovered`` (the rerun or
next command ended in a consistent state: for a refusal, the refusal itself left the project consistent), ``ok`` (the
expected behaviour held), ``seconds`` and ``detail`` (the commands run with exit code, duration and stderr tail).
Writes ``reports/faults.json`` in the base project (and ``--out``): ``{"faults": [...], "totals": {"faults", "ok",
"recovered"}}``; exits 1 when an entry is not ok. About 3 minutes on 2 idle cores with ``--jobs 2`` (under 1 min of it
the base project; most of a command's time is its imports and stores, so the faults share commands where one
command can show two of them); ``--base DIR --only NAME`` reruns single faults on a project kept by ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from citer.reaper import alive, descendants, pids, stat

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL, ALIAS = "citer-router", "champion"
PENDING = ".state/promotion_pending.json"
OWNED = ("reports", "artifacts", "outputs")
GRACE_S = 5.0  # a process of a killed command may outlive it this long (the reaper's poll + SIGTERM grace)
SMALL, BIG = "data/faults_small.jsonl", "data/faults_route.jsonl"  # route inputs: a check, a longer run
N_BIG = 40
MID_S = 4.0  # the mid-sweep kill, this long after the sweep took the project lock (the locked part: ~15 s)

# The tests' tiny project (tests/conftest.py TINY), cut further: a command's cost is mostly its imports and stores,
# so the work is kept to the least that still exercises each stage: 16 new tokens, one τ, no ablation routers, no
# iteration-1/oracle/speculative sweep methods, small route chunks (a killed route leaves a partial file).
PROJECT_PARAMS: dict[str, Any] = {
    "synth": {"n_train": 200, "n_dev": 12, "n_test": 12},
    "validate": {"files": [["data/embedded/math_test.jsonl", "math"]]},  # one split: each costs a GE context
    "bootstrap": {"slm_pretrain": {"steps": 20, "lr": 3e-3}, "llm_pretrain": {"steps": 30, "lr": 3e-3}},
    "finetune": {"max_steps": 5, "eval_examples": 4},
    "eval": {"n_examples": 4, "max_new_tokens": 16},
    "labels": {"n_examples": 12, "max_new_tokens": 16},
    "router": {"epochs": 3, "min_val_auc": 0.0, "ablations": []},
    "registry": {"min_eval_examples": 1},
    "sweep": {
        "n_examples": 6,
        "llm_fractions": [0.3],
        "max_new_tokens": 16,
        "iter1": False,
        "oracle": False,
        "speculative": False,
        "query": {"train_examples": 8, "epochs": 5},
        "intervals": {"resamples": 100},
        "rule": {"kind": "max_accuracy_under_bytes", "bytes_budget_rel_llm": 0.99},
    },
    "inference": {"batch_size": 8, "max_new_tokens": 16},
}

# (key, value, command): each must fail before any work, in one line naming the key.
BAD_PARAMS: list[tuple[str, Any, list[str]]] = [
    ("router.epochs", -1, ["router", "train", "--iteration", "1"]),
    ("router.lr", 0, ["router", "iterate"]),
    ("router.batch_size", 0, ["router", "train", "--iteration", "1"]),
    ("router.dropout", 1.5, ["router", "iterate"]),
    ("models.device", "tpu9", ["route"]),
    ("eval.n_examples", -298, ["eval", "models"]),
    ("sweep.rule.accuracy_ratio", -1, ["eval", "sweep"]),
    ("registry.min_eval_examples", 0, ["eval", "sweep"]),
]


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


# ---------------------------------------------------------------------------------------------------------------- #
# Processes (/proc)


def cmdline(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]


def in_dir(root: Path) -> dict[int, str]:
    """Live processes (not this one, no zombies) whose working directory is ``root`` or below it: pid -> start
    time."""
    out = {}
    for pid in pids():
        if pid == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        st = stat(pid)
        if st is not None and cwd.is_relative_to(root):
            out[pid] = st[1]
    return out


class TreeWatch:
    """Notes every descendant of ``pid`` (and its command line) every 0.1 s while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[str, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def snapshot(self) -> None:
        # Zombies too: a child that already died still counts as one the command started.
        for pid, start in descendants(self.pid, zombies=True).items():
            if pid not in self.seen:
                self.seen[pid] = (start, cmdline(pid))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.snapshot()
            self._stop.wait(0.1)

    def stop(self) -> None:
        self.snapshot()
        self._stop.set()
        self._thread.join()

    def matching(self, text: str) -> bool:
        return any(text in cmd for _, cmd in self.seen.values())


# ---------------------------------------------------------------------------------------------------------------- #
# Commands


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


# ---------------------------------------------------------------------------------------------------------------- #
# Project state


def registry(root: Path) -> dict[str, Any]:
    """The registry read straight from the project's sqlite store: versions (version -> run id), the alias, citer's
    alias tag and retired versions."""
    db = root / "mlflow.db"
    for attempt in range(40):
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                versions = {
                    str(v): r
                    for v, r in con.execute(
                        "select version, run_id from model_versions where name=?", (MODEL,)
                    )
                }
                alias = con.execute(
                    "select version from registered_model_aliases where name=? and alias=?", (MODEL, ALIAS)
                ).fetchone()
                tag = con.execute(
                    "select value from registered_model_tags where name=? and key=?",
                    (MODEL, f"citer.alias.{ALIAS}"),
                ).fetchone()
                retired = [
                    str(v)
                    for (v,) in con.execute(
                        "select version from model_version_tags where name=? and key='citer.retired'",
                        (MODEL,),
                    )
                ]
                locations = dict(
                    (str(v), loc)
                    for v, loc in con.execute(
                        "select version, storage_location from model_versions where name=?", (MODEL,)
                    )
                )
            finally:
                con.close()
            return {
                "versions": versions,
                "alias": str(alias[0]) if alias else None,
                "alias_tag": tag[0] if tag else None,
                "retired": retired,
                "locations": locations,
            }
        except sqlite3.OperationalError:
            if attempt == 39:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def leftovers(root: Path) -> list[str]:
    """What killed atomic writers leave: ``.{name}.*.tmp`` and ``.{name}.old-{pid}`` under the owned directories."""
    out = []
    for d in OWNED:
        base = root / d
        if base.is_dir():
            out += [
                str(p.relative_to(root))
                for p in base.rglob(".*")
                if p.name.endswith(".tmp") or ".old-" in p.name
            ]
    return sorted(out)


def promotion(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / "reports" / "promotion.json").read_text())
    except (OSError, ValueError):
        return None


def problems(root: Path) -> list[str]:
    """Why the project is not in a consistent state (empty: consistent)."""
    out = []
    reg = registry(root)
    if left := leftovers(root):
        out.append(f"leftovers {left}")
    if (root / PENDING).exists():
        out.append(f"{PENDING} still there")
    if reg["alias"] is not None and reg["alias"] not in reg["versions"]:
        out.append(f"alias -> v{reg['alias']}, which does not exist")
    if reg["alias_tag"] is not None and reg["alias"] != reg["alias_tag"]:
        out.append(f"citer's alias tag says v{reg['alias_tag']}, the alias is {reg['alias']}")
    if reg["alias"] is not None and reg["alias"] in reg["retired"]:
        out.append(f"alias -> v{reg['alias']}, which is retired")
    rec = promotion(root)
    if rec is None:
        out.append("reports/promotion.json missing or not JSON")
    elif rec.get("version") is not None and str(rec["version"]) not in reg["versions"]:
        out.append(f"promotion.json names v{rec['version']}, which does not exist")
    return out


def files_state(root: Path, dirs: tuple[str, ...] = OWNED) -> dict[str, tuple[int, int, str]]:
    """Every file under ``dirs``: (size, mtime_ns, sha256), to tell whether a command changed anything."""
    out = {}
    for d in dirs:
        for p in sorted((root / d).rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p.relative_to(root))] = (
                    st.st_size,
                    st.st_mtime_ns,
                    hashlib.sha256(p.read_bytes()).hexdigest(),
                )
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def describe(root: Path) -> str:
    """The state in one line: registry, promotion.json, pending intent, leftovers."""
    reg = registry(root)
    rec = promotion(root)
    rec_text = "unreadable" if rec is None else f"v{rec.get('version')} promoted={rec.get('promoted')}"
    parts = [
        f"versions {sorted(reg['versions'], key=int)}",
        f"alias {'v' + reg['alias'] if reg['alias'] else 'none'}",
        f"promotion.json {rec_text}",
    ]
    if reg["retired"]:
        parts.append(f"retired {reg['retired']}")
    if (root / PENDING).exists():
        parts.append("promotion pending")
    left = leftovers(root)
    parts.append(f"{len(left)} leftover(s)" + (f" {left[:3]}" if left else ""))
    return ", ".join(parts)


def output_rows(path: Path) -> tuple[list[int], bool]:
    """Indices of the rows in a route output, and whether its last line is torn."""
    if not path.exists():
        return [], False
    data = path.read_bytes()
    idx, torn = [], bool(data) and not data.endswith(b"\n")
    for line in data.splitlines()[: -1 if torn else None]:
        try:
            idx.append(int(json.loads(line)["index"]))
        except (ValueError, KeyError, TypeError):
            torn = True
    return idx, torn


def route_works(proj: Proj, name: str) -> tuple[bool, Cmd]:
    """``citer route`` with the champion on two questions into a fresh output."""
    out = f"outputs/check_{name}.jsonl"
    cmd = proj.run("route", "--input", SMALL, "--output", out, timeout=150)
    rows, _ = output_rows(proj.root / out)
    return cmd.rc == 0 and rows == [0, 1], cmd


def routers_load(root: Path) -> list[str]:
    """Router directories that do not load (``citer.routing.mlp.load_router``)."""
    from citer.routing.mlp import load_router

    bad = []
    for d in sorted((root / "artifacts" / "routers").iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            try:
                load_router(d)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                bad.append(f"{d.name}: {type(exc).__name__}: {str(exc)[:120]}")
    return bad


# ---------------------------------------------------------------------------------------------------------------- #
# Killing at a point


def lock_held_by(root: Path, pid: int) -> bool:
    try:
        return json.loads((root / ".state" / "project.lock.json").read_text())["pid"] == pid
    except (OSError, ValueError, KeyError):
        return False


@dataclass
class Kill:
    fired: bool  # the fault point was reached (else the command ended or the wait timed out first)
    at_s: float
    seen: list[str]  # command lines of the descendants seen
    survivors: list[str]  # processes still alive GRACE_S after the kill (then stopped by this script)

    def text(self) -> str:
        if not self.survivors:
            return f"no process of it alive {GRACE_S:g} s later ({len(self.seen)} descendant(s) seen)"
        return f"{len(self.survivors)} process(es) alive {GRACE_S:g} s after the kill: {self.survivors}"


def kill_when(proj: Proj, proc: Proc, point: Callable[[TreeWatch], bool], timeout: float) -> Kill:
    """SIGKILL the command once ``point`` holds; then wait GRACE_S for its descendants (and anything else running in
    the project) to go, and stop what is left."""
    watch = TreeWatch(proc.pid)
    fired = False
    while proc.running() and time.monotonic() - proc.t0 < timeout:
        if point(watch):
            fired = True
            break
        time.sleep(0.02)
    watch.snapshot()
    at = time.monotonic() - proc.t0
    if proc.running():
        proc.killed = "fault"
        os.kill(proc.pid, signal.SIGKILL)
    proj.finish(proc, timeout=30)
    watch.stop()
    deadline = time.monotonic() + GRACE_S
    tracked = {pid: start for pid, (start, _) in watch.seen.items()}
    while time.monotonic() < deadline:
        tracked |= in_dir(proj.root)
        if not any(alive(p, s) for p, s in tracked.items()):
            break
        time.sleep(0.1)
    tracked |= in_dir(proj.root)
    left = [p for p, s in tracked.items() if alive(p, s)]
    survivors = [f"pid {p}: {watch.seen[p][1] if p in watch.seen else cmdline(p)}" for p in left]
    for p in left:  # our own command's processes: stop them so they do not hold the project
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return Kill(fired, round(at, 2), [cmd for _, cmd in watch.seen.values()], survivors)


# ---------------------------------------------------------------------------------------------------------------- #
# The faults


@dataclass
class Ctx:
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


def fault_kill_sweep(ctx: Ctx) -> list[dict[str, Any]]:
    """Three kills of ``citer eval sweep`` in a row in one copy (each next sweep starts where the last kill left the
    project), then one sweep to the end and a route with the champion. The copy starts without a champion, so the
    last killed sweep meant to move the alias."""
    t0 = time.monotonic()
    proj = ctx.copy("kill_sweep")
    proj.drop_champion()
    kills: list[tuple[str, str, Kill, str]] = []

    def server(proc: Proc) -> Callable[[TreeWatch], bool]:  # its own temporary Prefect server started, + 1 s
        seen: list[float] = []

        def point(watch: TreeWatch) -> bool:
            if not seen and watch.matching("uvicorn"):
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= 1.0

        return point

    def mid(
        proc: Proc,
    ) -> Callable[[TreeWatch], bool]:  # MID_S into the locked stage: routers, champion, decoding
        held: list[float] = []

        def point(_w: TreeWatch) -> bool:
            if not held and lock_held_by(proj.root, proc.pid):
                held.append(time.monotonic())
            return bool(held) and time.monotonic() - held[0] >= MID_S

        return point

    def registered(proc: Proc) -> Callable[[TreeWatch], bool]:  # the registry gained a version
        n0 = len(registry(proj.root)["versions"])
        return lambda _w: len(registry(proj.root)["versions"]) > n0

    steps = [
        (
            "kill_sweep_own_server",
            "its own Prefect server starting (+1 s), no PREFECT_API_URL",
            server,
            False,
        ),
        ("kill_sweep_mid", f"project lock held + {MID_S:g} s", mid, True),
        ("kill_sweep_after_register", "the registry gained a version", registered, True),
    ]
    for name, where, make, api in steps:
        proc = proj.start("eval", "sweep", api=api)
        kill = kill_when(proj, proc, make(proc), timeout=180)
        kills.append((name, where, kill, f"killed at {kill.at_s} s: {describe(proj.root)}; {kill.text()}"))
    after_kill = registry(proj.root)
    rerun = proj.run("eval", "sweep", timeout=300)
    state = problems(proj.root)
    routes, _ = route_works(proj, "kill_sweep")
    reg, rec = registry(proj.root), promotion(proj.root) or {}
    recovered = rerun.rc == 0 and not state and routes and reg["alias"] is not None
    expect = []
    if (
        len(after_kill["versions"]) > 1
    ):  # the last kill came after registering: the rerun completes its decision
        killed_v = max(after_kill["versions"], key=int)
        rerun_v = str(rec.get("version"))
        if not (reg["alias"] == killed_v or (rec.get("promoted") and reg["alias"] == rerun_v)):
            expect.append(
                f"alias {reg['alias']}, expected v{killed_v} (the killed sweep's decision) or v{rerun_v}"
            )
        if str(rec.get("previous")) != killed_v:
            expect.append(f"the rerun compared against {rec.get('previous')}, not the recovered v{killed_v}")
    out = []
    for name, where, kill, left in kills:
        extra = []
        if name == "kill_sweep_own_server" and not kill.seen:
            extra.append("no temporary Prefect server was seen")
        issues = extra + (expect if name == "kill_sweep_after_register" else [])
        ok = kill.fired and not kill.survivors and recovered and not issues
        out.append(
            entry(
                name,
                "kill",
                left,
                recovered,
                ok,
                t0,
                proj,
                fault_point=where,
                fault_point_reached=kill.fired,
                descendants_seen=kill.seen,
                survivors=kill.survivors,
                after_rerun=describe(proj.root),
                problems=state,
                route_works=routes,
                unexpected=issues,
                note="the three kills run one after another in one copy; recovered: the final rerun",
            )
        )
    return out


def fault_kill_iterate(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("kill_iterate")
    proj.set_param("router.lr", 0.002)  # every router retrains (labels after iteration 1 follow their router)
    routers = proj.root / "artifacts"
    before = files_state(proj.root, ("artifacts",))
    proc = proj.start("router", "iterate")

    def point(_w: TreeWatch) -> bool:  # an atomic writer is mid-write, or a router was already replaced
        if any(p.name.endswith(".tmp") for p in routers.rglob(".*")):
            return True
        return any(
            files_state(proj.root, ("artifacts",)).get(k) != v
            for k, v in before.items()
            if k.endswith("router.json")
        )

    kill = kill_when(proj, proc, point, timeout=150)
    now = files_state(proj.root, ("artifacts",))
    left = (
        f"killed at {kill.at_s} s: {len(changed(before, now))} artifact file(s) changed, leftovers "
        f"{leftovers(proj.root)}; {kill.text()}"
    )
    rerun = proj.run("router", "iterate", timeout=240)
    bad = routers_load(proj.root)
    incomplete = [
        str(d.relative_to(proj.root))
        for d in (routers / "routers").iterdir()
        if d.is_dir() and not {"router.json", "router.safetensors"} <= {f.name for f in d.iterdir()}
    ]
    recovered = rerun.rc == 0 and not bad and not incomplete and not leftovers(proj.root)
    ok = kill.fired and not kill.survivors and recovered
    return [
        entry(
            "kill_router_iterate",
            "kill",
            left,
            recovered,
            ok,
            t0,
            proj,
            routers_not_loading=bad,
            incomplete_dirs=incomplete,
            rerun_said=rerun.out.strip().splitlines()[-6:],
            survivors=kill.survivors,
        )
    ]


class AliasWatch:
    """Every value the alias takes while two commands run (sampled every 0.1 s)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.values: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(sqlite3.Error):
                a = registry(self.root)["alias"]
                if not self.values or self.values[-1] != a:
                    self.values.append(a)
            self._stop.wait(0.1)

    def stop(self) -> list[str | None]:
        self._stop.set()
        self._thread.join()
        return self.values


def _second_after_lock(proj: Proj, first: Proc, args: tuple[str, ...], delay: float) -> Proc | None:
    """Start ``args`` ``delay`` s after ``first`` holds the project lock (None: it ended without taking it)."""
    while first.running() and not lock_held_by(proj.root, first.pid):
        time.sleep(0.05)
    time.sleep(delay)
    return proj.start(*args) if first.running() else None


def fault_concurrent_sweeps(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("concurrent_sweeps")
    proj.drop_champion()  # the first sweep promotes; the second must compare against that new champion
    watch = AliasWatch(proj.root)
    a = proj.start("eval", "sweep")
    b = _second_after_lock(proj, a, ("eval", "sweep"), 1.0)
    ra = proj.finish(a, 300)
    rb = proj.finish(b, 300) if b else None
    seen = watch.stop()
    ja, jb = ra.json(), rb.json() if rb else {}
    won = {str(j["version"]) for j in (ja, jb) if j.get("promoted") and j.get("version") is not None}
    reg = registry(proj.root)
    final = (
        str(jb["version"]) if jb.get("promoted") else (str(ja.get("version")) if ja.get("promoted") else None)
    )
    issues = []
    if rb is None or "waiting for the project lock" not in rb.err:
        issues.append("the second sweep did not wait for the lock")
    if ja.get("promoted") and str(jb.get("previous")) != str(ja.get("version")):
        issues.append(
            f"the second compared against {jb.get('previous')}, not the first's v{ja.get('version')}"
        )
    if any(v is not None and v not in won for v in seen):
        issues.append(f"the alias took a version that lost: {seen} (winners {sorted(won)})")
    if reg["alias"] != final:
        issues.append(f"alias v{reg['alias']} at the end, expected {final}")
    state = problems(proj.root)
    recovered = ra.rc == 0 and rb is not None and rb.rc == 0 and not state
    left = (
        f"first: v{ja.get('version')} promoted={ja.get('promoted')}; second: v{jb.get('version')} "
        f"promoted={jb.get('promoted')} (previous {jb.get('previous')}); alias seen {seen}; {describe(proj.root)}"
    )
    return [
        entry(
            "concurrent_sweeps_wait",
            "concurrent",
            left,
            recovered,
            recovered and not issues,
            t0,
            proj,
            issues=issues,
            problems=state,
            second_reason=jb.get("reason"),
        )
    ]


def fault_nowait_and_min_eval(ctx: Ctx) -> list[dict[str, Any]]:
    """Two faults, one sweep: with ``lock.wait: false`` a second sweep refuses while the first runs; the first, with
    no champion and ``registry.min_eval_examples`` above ``sweep.n_examples``, must not promote."""
    t0 = time.monotonic()
    proj = ctx.copy("nowait_min_eval")
    proj.set_param("lock.wait", False)
    proj.drop_champion()  # with no champion the gate is the only thing that can keep the candidate out
    proj.set_param("registry.min_eval_examples", 100)  # sweep.n_examples is 12
    a = proj.start("eval", "sweep")
    b = _second_after_lock(proj, a, ("eval", "sweep"), 1.0)
    rb = proj.finish(b, 120) if b else None
    ra = proj.finish(a, 300)
    refused = rb is not None and rb.one_line_error("lock")
    state = problems(proj.root)
    recovered = ra.rc == 0 and not state
    left = (
        f"second: rc {rb.rc if rb else None} {rb.error_lines[:1] if rb else ''}; first: rc {ra.rc}; "
        f"{describe(proj.root)}"
    )
    nowait = entry(
        "concurrent_sweeps_nowait",
        "concurrent",
        left,
        recovered,
        recovered and refused,
        t0,
        proj,
        problems=state,
    )
    rec, reg = promotion(proj.root) or {}, registry(proj.root)
    held = rec.get("promoted") == 0 and "min_eval_examples" in str(rec.get("reason")) and reg["alias"] is None
    left = f"promoted={rec.get('promoted')}, reason: {str(rec.get('reason'))[:160]}; alias {reg['alias']}"
    gate = entry(
        "min_eval_examples", "registry", left, recovered, recovered and held, t0, proj, problems=state
    )
    return [nowait, gate]


def fault_routes(ctx: Ctx) -> list[dict[str, Any]]:
    """Three faults, one copy and three routes into one output: the champion's stored pyfunc code gains a line that
    writes a marker file (no route may run it); a route is killed while it writes; the rerun resumes it while a
    second route into the same output starts 0.5 s after the first holds the lock (it waits, then skips every row)."""
    t0 = time.monotonic()
    proj = ctx.copy("routes")
    marker = proj.root / "PYFUNC_CODE_RAN"
    code = sorted(p for p in _champion_artifacts(proj).rglob("*.py"))
    line = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('the stored pyfunc code ran')\n"
    for f in code:
        f.write_text(line + f.read_text())
    out = proj.root / "outputs" / "faults_route.jsonl"
    args = ("route", "--input", BIG, "--output", str(out.relative_to(proj.root)))
    proc = proj.start(*args)
    kill = kill_when(proj, proc, lambda _w: len(output_rows(out)[0]) >= 8, timeout=150)
    rows, torn = output_rows(out)
    left = f"killed at {kill.at_s} s: {len(rows)} of {N_BIG} rows" + (", a torn last line" if torn else "")
    left += f", {len(leftovers(proj.root))} leftover(s); {kill.text()}"
    a = proj.start(*args)  # the rerun, resuming
    b = _second_after_lock(proj, a, args, 0.5)
    ra, rb = proj.finish(a, 240), proj.finish(b, 240) if b else None
    after, torn_after = output_rows(out)
    exact = after == list(range(N_BIG)) and not torn_after and not leftovers(proj.root)
    recovered = ra.rc == 0 and exact
    both = recovered and rb is not None and rb.rc == 0 and rb.json().get("n_skipped") == N_BIG
    ran = marker.exists()
    common = {"rows_after": len(after), "unique_indices": len(set(after)), "torn_after": torn_after}
    return [
        entry(
            "kill_route",
            "kill",
            left,
            recovered,
            kill.fired and 0 < len(rows) < N_BIG and not kill.survivors and recovered,
            t0,
            proj,
            rows_at_kill=len(rows),
            n_skipped_by_rerun=ra.json().get("n_skipped"),
            survivors=kill.survivors,
            **common,
        ),
        entry(
            "concurrent_routes",
            "concurrent",
            f"{len(after)} rows for {N_BIG} inputs ({len(set(after))} distinct), torn={torn_after}; second: "
            + (
                f"rc {rb.rc}, n_skipped {rb.json().get('n_skipped')}"
                if rb
                else "not started (the first ended)"
            ),
            both,
            both,
            t0,
            proj,
            second_started_while_first_ran=b is not None,
            **common,
        ),
        entry(
            "tampered_pyfunc_code",
            "tampered",
            f"{len(proj.cmds)} routes loaded the champion, marker written={ran}, {len(after)} rows routed",
            recovered,
            bool(code) and not ran and recovered,
            t0,
            proj,
            tampered=[str(f.relative_to(proj.root)) for f in code],
            note="router_sha256 covers router.safetensors and router.json only; citer's loads never import the "
            "stored code (mlflow.pyfunc.load_model of the registry model would)",
        ),
    ]


def fault_bad_params(ctx: Ctx) -> list[dict[str, Any]]:
    proj = ctx.copy("bad_params")
    original = (proj.root / "params.yaml").read_text()
    before, reg0 = files_state(proj.root), registry(proj.root)
    out = []
    for key, value, args in BAD_PARAMS:
        t0 = time.monotonic()
        proj.cmds = []
        proj.set_param(key, value)
        cmd = proj.run(*args, timeout=60)
        (proj.root / "params.yaml").write_text(original)
        touched = changed(before, files_state(proj.root))
        same_registry = registry(proj.root) == reg0
        one = cmd.one_line_error(key)
        stray = [line for line in cmd.err.splitlines() if line.strip() and not line.startswith("error:")]
        recovered = not touched and same_registry and not problems(proj.root)
        left = f"rc {cmd.rc}, {len(cmd.error_lines)} error line(s), {len(touched)} file(s) changed"
        out.append(
            entry(
                f"bad_param {key}={value}",
                "bad_params",
                left,
                recovered,
                one and recovered,
                t0,
                proj,
                error=cmd.error_lines,
                other_stderr=stray[:3],
                changed=touched,
            )
        )
    return out


def _refusal(
    proj: Proj, cmd: Cmd, before: dict[str, Any], reg0: dict[str, Any], *needles: str
) -> dict[str, Any]:
    """What a refused command left: the checks shared by the corrupt, tampered and registry faults. ``changed``:
    files that existed before and differ or are gone; ``created``: new files (noted, not a failure)."""
    after = files_state(proj.root)
    reg = registry(proj.root)
    return {
        "one_line": cmd.one_line_error(*needles),
        "error": cmd.error_lines,
        "changed": [k for k in changed(before, after) if k in before],
        "created": sorted(after.keys() - before.keys()),
        "new_versions": sorted(set(reg["versions"]) - set(reg0["versions"])),
        "alias_moved": reg["alias"] != reg0["alias"],
        "pending": (proj.root / PENDING).exists(),
        "leftovers": leftovers(proj.root),
    }


def _clean(r: dict[str, Any], allow_changes: bool = False) -> bool:
    return (
        (allow_changes or not r["changed"])
        and not r["new_versions"]
        and not r["alias_moved"]
        and not r["pending"]
        and not r["leftovers"]
    )


def _corrupt(ctx: Ctx, fault: str, rel: str, *args: str) -> list[dict[str, Any]]:
    """Truncate the file ``rel`` to half its size, run ``citer *args``: one line naming the file, nothing changed."""
    t0 = time.monotonic()
    proj = ctx.copy(fault)
    f = proj.root / rel
    with f.open("r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    before, reg0 = files_state(proj.root), registry(proj.root)
    cmd = proj.run(*args, timeout=180)
    r = _refusal(proj, cmd, before, reg0, f.name)
    recovered = _clean(r) and not problems(proj.root)
    left = f"rc {cmd.rc}, {r['error'][:1]}, new versions {r['new_versions']}, {len(r['changed'])} file(s) changed"
    return [
        entry(fault, "corrupt", left, recovered, r["one_line"] and recovered, t0, proj, truncated=rel, **r)
    ]


def fault_corrupt_router(ctx: Ctx) -> list[dict[str, Any]]:
    return _corrupt(ctx, "corrupt_router_file", "artifacts/routers/iter2/router.safetensors", "eval", "sweep")


def fault_corrupt_labels(ctx: Ctx) -> list[dict[str, Any]]:
    rel = "artifacts/labels/iter2/tokens.parquet"
    return _corrupt(ctx, "corrupt_labels_parquet", rel, "router", "train", "--iteration", "2")


def _champion_artifacts(proj: Proj) -> Path:
    """The champion's model directory in this copy's artifact store (``mlartifacts/models/m-.../artifacts``)."""
    reg = registry(proj.root)
    loc = reg["locations"][reg["alias"]]
    rel = loc[loc.index("mlartifacts/") :]
    return proj.root / rel


def fault_tampered_router(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("tampered_router")
    files = sorted(_champion_artifacts(proj).rglob("router.json"))
    meta = json.loads(files[0].read_text())
    meta["dropout"] = float(meta.get("dropout", 0.1)) + 0.01
    files[0].write_text(json.dumps(meta, indent=2))
    before, reg0 = files_state(proj.root), registry(proj.root)
    # The pipeline's own output, finished with the champion's τ: another τ makes the route decode it again, so it
    # must load (and check) the router; the refusal must leave the finished predictions as they were.
    cmd = proj.run("route", "--llm-fraction", "0.3", timeout=150)
    r = _refusal(proj, cmd, before, reg0, "sha256")
    recovered = _clean(r) and not problems(proj.root)
    left = f"rc {cmd.rc}, {r['error'][:1]}, changed {r['changed']}"
    return [
        entry(
            "tampered_router_json",
            "tampered",
            left,
            recovered,
            r["one_line"] and recovered,
            t0,
            proj,
            tampered=str(files[0].relative_to(proj.root)),
            **r,
        )
    ]


def fault_dangling_alias(ctx: Ctx) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    proj = ctx.copy("dangling_alias")
    champion = registry(proj.root)["alias"]
    proj.client().delete_model_version(MODEL, champion)
    before, reg0 = files_state(proj.root), registry(proj.root)
    sweep = proj.run("eval", "sweep", timeout=180)
    r_sweep = _refusal(proj, sweep, before, reg0, "alias")
    route = proj.run("route", "--input", SMALL, "--output", "outputs/dangling.jsonl", timeout=150)
    r_route = _refusal(proj, route, before, reg0, "alias")
    left = (
        f"v{champion} deleted: sweep rc {sweep.rc} {r_sweep['error'][:1]}; route rc {route.rc}; "
        f"new versions {r_sweep['new_versions']}; {describe(proj.root)}"
    )
    # The way out the message names: delete citer's alias tag; the project is then consistent, with no champion.
    proj.client().delete_registered_model_tag(MODEL, f"citer.alias.{ALIAS}")
    # promotion.json still names the deleted version until the next sweep rewrites it: part of the fault itself.
    state = [p for p in problems(proj.root) if not p.startswith("promotion.json names")]
    recovered = not state and _clean(r_sweep) and _clean(r_route)
    ok = r_sweep["one_line"] and _clean(r_sweep) and r_route["one_line"] and _clean(r_route) and recovered
    return [
        entry(
            "dangling_alias",
            "registry",
            left,
            recovered,
            ok,
            t0,
            proj,
            sweep=r_sweep,
            route=r_route,
            after_recovery=describe(proj.root),
            problems=state,
        )
    ]


# Heaviest first, so two workers finish close together.
FAULTS: list[Callable[[Ctx], list[dict[str, Any]]]] = [
    fault_kill_sweep,
    fault_concurrent_sweeps,
    fault_routes,
    fault_nowait_and_min_eval,
    fault_dangling_alias,
    fault_kill_iterate,
    fault_corrupt_router,
    fault_tampered_router,
    fault_corrupt_labels,
    fault_bad_params,
]


# ---------------------------------------------------------------------------------------------------------------- #
# The base project and the matrix


def build_base(root: Path, api_url: str | None, timeout: float = 900) -> Path:
    """The tiny finished project: tracked files without tests, shrunken params, one ``citer pipeline``."""
    try:
        files = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(REPO)) for d in ("citer", "flows") for p in (REPO / d).rglob("*.py")]
        files += ["params.yaml", "dvc.yaml"]
    for f in files:
        if f.startswith("tests/") or not (REPO / f).is_file():
            continue
        dst = root / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst)
    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), PROJECT_PARAMS)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    logs = root.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    proj = Proj(root, api_url, logs)
    cmd = proj.run("pipeline", timeout=timeout)
    if cmd.rc != 0 or registry(root)["alias"] is None:
        raise RuntimeError(f"citer pipeline did not leave a champion (rc {cmd.rc}): {cmd.err[-2000:]}")
    test = [line for line in (root / params["data"]["test"]).read_text().splitlines() if line.strip()]
    (root / SMALL).write_text("\n".join(test[:2]) + "\n")
    (root / BIG).write_text("\n".join(test[i % len(test)] for i in range(N_BIG)) + "\n")
    return root


def run_matrix(
    work: Path,
    api_url: str | None,
    jobs: int = 2,
    only: list[str] | None = None,
    base: Path | None = None,
) -> dict[str, Any]:
    """Build the base project under ``work`` (or reuse ``base``), run every fault (``jobs`` at a time) and write
    ``reports/faults.json`` in the base project; returns the report."""
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    if base is None:
        base = build_base(work / "base" / "project", api_url)
    built = time.monotonic() - t0
    ctx = Ctx(base, work, api_url)
    faults = [f for f in FAULTS if not only or any(o in f.__name__ for o in only)]

    def one(fn: Callable[[Ctx], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        t = time.monotonic()
        try:
            return fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken fault is an entry, not the end of the report
            name = fn.__name__.removeprefix("fault_")
            return [entry(name, "error", f"the fault itself failed: {exc!r}", False, False, t, None)]

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        entries = [e for group in pool.map(one, faults) for e in group]
    report = {
        "faults": entries,
        "totals": {
            "faults": len(entries),
            "ok": sum(e["ok"] for e in entries),
            "recovered": sum(e["recovered"] for e in entries),
        },
        "seconds": {"build": round(built, 1), "total": round(time.monotonic() - t0, 1)},
        "jobs": jobs,
    }
    out = base / "reports" / "faults.json"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out)
    return report


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """``PREFECT_API_URL`` when set; else one temporary Prefect server for every command of the run."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also copy reports/faults.json here")
    ap.add_argument("--jobs", type=int, default=2, help="faults run at a time (default 2)")
    ap.add_argument("--workdir", type=Path, help="where the projects go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--only", help="comma-separated substrings of fault names")
    ap.add_argument(
        "--base", type=Path, help="a finished base project from an earlier --keep run (no rebuild)"
    )
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="citer-faults-"))
    try:
        with prefect_api() as url:
            only = args.only.split(",") if args.only else None
            report = run_matrix(work, url, args.jobs, only, base=args.base)
        for e in report["faults"]:
            flag = "ok  " if e["ok"] else "FAIL"
            print(
                f"{flag} {e['kind']:<10} {e['fault']:<40} {e['seconds']:>6.1f}s  {e['what_was_left'][:150]}"
            )
        print(json.dumps(report["totals"] | {"seconds": report["seconds"]}))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy((args.base or work / "base" / "project") / "reports" / "faults.json", args.out)
        return 0 if report["totals"]["ok"] == report["totals"]["faults"] else 1
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"projects kept in {work}")


if __name__ == "__main__":
    sys.exit(main())
