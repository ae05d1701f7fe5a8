"""How long the pipeline takes: ``python bench/pipeline.py repro`` and ``... quick``.

``repro``: the pipeline from a fresh clone, quiet and with one core kept busy by another process. Each mode clones
HEAD into a temporary directory (no data, models, reports or MLflow store of an earlier run), runs ``dvc repro`` there
(``--command pipeline``: ``citer pipeline``) with this interpreter's tools and times it. Mode ``loaded`` first starts
a process that spins on one core (pinned to the last core this process may use) and stops it after. Prints each
mode's wall time and its stages' (the clone's ``reports/provenance.json``), and loaded/quiet against the issue's bound
(1.6); writes ``reports/bench_load.json``. Measure on an otherwise quiet machine. ``--set KEY=VALUE`` (dotted params
keys, YAML values; repeatable) shrinks the run for a quick check of the bench itself; ``--nice N`` runs the command
and the busy process at that niceness (a check beside other work); ``--keep DIR`` keeps each mode's clone (its
``dvc.lock``, reports and outputs: the records a code change lands with) at ``DIR/MODE``.

``quick``: median seconds of quick commands over ``--repeat`` runs in a temporary project, against the 5 s budget:
``citer --help``, ``citer data validate FILE -f math`` on 10 rows (no flow, no tracking), and for the record the
``validate`` stage (a Prefect flow run and an MLflow run; its floor is Prefect's temporary server, unless
``PREFECT_API_URL`` names a running one). The rows: ``$CITER_SHARED_DATA/math/gsm8k_test.jsonl``'s first 10, else
synthesised. Writes ``reports/bench_cli.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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

BIN = Path(sys.executable).parent
BOUND = 1.6  # issue #37: loaded <= 1.6 x quiet
BUDGET_S = 5.0  # issue #11: a quick command


def run(
    cmd: list[str], cwd: Path, nice: int = 0, drop: tuple[str, ...] = ("CITER_ROOT", "MLFLOW_TRACKING_URI")
) -> float:
    """Seconds ``cmd`` took in ``cwd`` with its code (not an editable install's) and our tools; exits on failure."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(cwd))
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, preexec_fn=lambda: os.nice(nice)
    )
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-1500:]}")
    return time.perf_counter() - t0


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


def repro_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    clone = tmp / mode
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    if args.set:
        set_params(clone / "params.yaml", args.set)
    cmd = [str(BIN / "dvc"), "repro"] if args.command == "dvc" else [str(BIN / "citer"), "pipeline"]
    busy = None
    if mode == "loaded":  # a process spinning on one core: the last one this process may use
        spin = [sys.executable, "-c", "while True: pass"]
        busy = subprocess.Popen(spin, preexec_fn=lambda: os.nice(args.nice))
        os.sched_setaffinity(busy.pid, {max(os.sched_getaffinity(0))})
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    try:
        wall = run(cmd, clone, args.nice, ("CITER_ROOT", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    runs = read_json(clone / "reports" / "provenance.json").get("runs", {})
    # The clone's provenance holds the committed run's entries too: only this run's stages count.
    stages = {k: v["wall_s"] for k, v in runs.items() if v.get("started_at", "")[:19] >= since}
    if args.keep:  # the run's lock, reports and outputs, to commit as the records of this code
        dest = Path(args.keep) / mode
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(clone, dest)
    shutil.rmtree(clone, ignore_errors=True)
    print(f"{mode:>6}: {wall:7.1f} s  " + "  ".join(f"{k} {v:.0f}" for k, v in stages.items()), flush=True)
    return {"wall_s": round(wall, 1), "stages_wall_s": stages}


def repro(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"command": args.command, "commit": git_head(ROOT, dirty=True), "cores": len(os.sched_getaffinity(0)),
                           "params_set": args.set}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="citer-bench-load-") as tmp:
        for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
            out[mode] = repro_mode(mode, args, Path(tmp))
    if "quiet" in out and "loaded" in out:
        ratio = out["loaded"]["wall_s"] / out["quiet"]["wall_s"]
        out |= {"loaded_over_quiet": round(ratio, 2), "bound": BOUND, "holds": ratio <= BOUND}
        print(
            f"loaded / quiet = {ratio:.2f} (bound {BOUND}: {'holds' if ratio <= BOUND else 'does not hold'})"
        )
    return out


def quick(args: argparse.Namespace) -> dict[str, Any]:
    citer, results = str(BIN / "citer"), []
    with tempfile.TemporaryDirectory(prefix="citer-bench-cli-") as tmp:
        proj = Path(tmp)
        shared = (
            Path(os.environ.get("CITER_SHARED_DATA", ROOT.parent / "shared/data")) / "math/gsm8k_test.jsonl"
        )
        if shared.is_file():
            lines = shared.read_text(encoding="utf-8").splitlines(keepends=True)[:10]
        else:
            lines = [json.dumps({"problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. \\boxed{{{i + 1}}}"}) + "\n"
                     for i in range(10)]  # fmt: skip
        (proj / "ten.jsonl").write_text("".join(lines), encoding="utf-8")
        data = "data: {format: math, train: ten.jsonl, dev: ten.jsonl, test: ten.jsonl}\n"
        (proj / "params.yaml").write_text(data, encoding="utf-8")
        cases = {
            "citer --help": [citer, "--help"],
            "citer data validate ten.jsonl -f math": [citer, "data", "validate", "ten.jsonl", "-f", "math"],
            "citer data validate (stage: flow + MLflow run)": [citer, "data", "validate"],
        }
        for name, cmd in cases.items():
            times = [run(cmd, proj) for _ in range(args.repeat)]
            med = statistics.median(times)
            results.append({"command": name, "median_s": round(med, 2), "runs_s": [round(t, 2) for t in times],
                            "ratio_to_budget": round(med / BUDGET_S, 2)})  # fmt: skip
            print(f"{name:<50} median {med:6.2f} s  ({med / BUDGET_S:.2f} x the {BUDGET_S:.0f} s budget)")
    return {"budget_s": BUDGET_S, "cpu_count": os.cpu_count(), "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="bench", required=True)
    rp = sub.add_parser("repro", help="the pipeline from a fresh clone, quiet and with one core busy")
    rp.add_argument("--command", choices=("dvc", "pipeline"), default="dvc")
    rp.add_argument("--modes", default="quiet,loaded", help="comma-separated: quiet, loaded")
    rp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    rp.add_argument("--nice", type=int, default=0)
    rp.add_argument("--keep", default="", help="move each mode's clone to DIR/MODE instead of deleting it")
    rp.add_argument("--out", default=str(ROOT / "reports" / "bench_load.json"))
    qp = sub.add_parser("quick", help="quick commands against the 5 s budget")
    qp.add_argument("--repeat", type=int, default=3)
    qp.add_argument("--out", default=str(ROOT / "reports" / "bench_cli.json"))
    args = ap.parse_args()
    started = time.perf_counter()
    out = {"repro": repro, "quick": quick}[args.bench](args)
    write_json(Path(args.out), out)
    name = {"repro": "load", "quick": "cli"}[args.bench]  # the names their reports had
    stamp_bench(args.out, name, args, time.perf_counter() - started)


if __name__ == "__main__":
    main()
