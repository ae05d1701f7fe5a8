"""The pipeline from a fresh clone, quiet and with one core kept busy by another process: ``python bench/load.py``.

Each mode clones HEAD into a temporary directory (no data, models, reports or MLflow store of an earlier run), runs
``dvc repro`` there (``--command pipeline``: ``citer pipeline``) with this interpreter's tools and times it. Mode
``loaded`` first starts a process that spins on one core (pinned to the last core this process may use) and stops
it after. Prints each mode's wall time and its stages' (the clone's ``reports/provenance.json``), and loaded/quiet
against the issue's bound (1.6); writes ``reports/bench_load.json``. Measure on an otherwise quiet machine.

``--set KEY=VALUE`` (dotted params keys, YAML values; repeatable) shrinks the run for a quick check of the bench
itself; ``--nice N`` runs the command and the busy process at that niceness (a check beside other work).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from citer.ops.io import read_json, write_json  # noqa: E402
from citer.tracking.provenance import git_head, stamp_bench  # noqa: E402

BOUND = 1.6  # issue #37: loaded <= 1.6 x quiet


def set_params(path: Path, assignments: list[str]) -> None:
    params = yaml.safe_load(path.read_text(encoding="utf-8"))
    for item in assignments:
        key, _, value = item.partition("=")
        *parents, last = key.split(".")
        node = params
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def busy_core(niceness: int) -> subprocess.Popen:
    """A process spinning on one core: the last one this process may use."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(niceness))
    os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    return proc


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    clone = tmp / mode
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    if args.set:
        set_params(clone / "params.yaml", args.set)
    bindir = Path(sys.executable).parent
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CITER_ROOT", "MLFLOW_TRACKING_URI", "PREFECT_API_URL")
    }
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(bindir / "dvc"), "repro"] if args.command == "dvc" else [str(bindir / "citer"), "pipeline"]
    busy = busy_core(args.nice) if mode == "loaded" else None
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    try:
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True,
                             preexec_fn=lambda: os.nice(args.nice))  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if res.returncode != 0:
        raise SystemExit(f"{mode}: {' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-1500:]}")
    runs = read_json(clone / "reports" / "provenance.json").get("runs", {})
    # The clone's provenance holds the committed run's entries too: only this run's stages count.
    stages = {k: v["wall_s"] for k, v in runs.items() if v.get("started_at", "")[:19] >= since}
    print(f"{mode:>6}: {wall:7.1f} s  " + "  ".join(f"{k} {v:.0f}" for k, v in stages.items()), flush=True)
    return {"wall_s": round(wall, 1), "stages_wall_s": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", choices=("dvc", "pipeline"), default="dvc")
    ap.add_argument("--modes", default="quiet,loaded", help="comma-separated: quiet, loaded")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_load.json"))
    args = ap.parse_args()
    started = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out: dict[str, Any] = {
        "command": args.command,
        "commit": git_head(ROOT, dirty=True),
        "cores": len(os.sched_getaffinity(0)),
    }
    out["params_set"] = args.set
    with tempfile.TemporaryDirectory(prefix="citer-bench-load-") as tmp:
        for mode in modes:
            out[mode] = run_mode(mode, args, Path(tmp))
            shutil.rmtree(Path(tmp) / mode, ignore_errors=True)
    if "quiet" in out and "loaded" in out:
        ratio = out["loaded"]["wall_s"] / out["quiet"]["wall_s"]
        out |= {"loaded_over_quiet": round(ratio, 2), "bound": BOUND, "holds": ratio <= BOUND}
        print(
            f"loaded / quiet = {ratio:.2f} (bound {BOUND}: {'holds' if ratio <= BOUND else 'does not hold'})"
        )
    write_json(Path(args.out), out)
    stamp_bench(args.out, "load", args, time.perf_counter() - started)


if __name__ == "__main__":
    main()
