"""How long the pipeline takes: ``python bench/pipeline.py repro``, ``... models`` and ``... quick``.

``repro``: the pipeline from a fresh clone, quiet and with one core kept busy by another process. Each mode clones
HEAD into a temporary directory (no data, models, reports or MLflow store of an earlier run), runs ``dvc repro`` there
(``--command pipeline``: ``citer pipeline``) with this interpreter's tools and times it. Mode ``loaded`` first starts
a process that spins on one core (pinned to the last core this process may use) and stops it after. Prints each
mode's wall time and its stages' (the clone's ``reports/provenance.json``), and loaded/quiet against the issue's bound
(1.6); writes ``reports/bench_load.json``. Measure on an otherwise quiet machine. ``--set KEY=VALUE`` (dotted params
keys, YAML values; repeatable) shrinks the run for a quick check of the bench itself; ``--nice N`` runs the command
and the busy process at that niceness (a check beside other work).

``models``: the embedded model stages in this process, in a scratch directory (``--work`` to keep it): synth,
bootstrap (tokenizer, SLM base, LLM), SLM finetune and eval, each phase's wall and CPU seconds (less sensitive to
other jobs on the cores), the pair's sizes and accuracies, the CPU count and load average. ``--params`` another
project's params. Writes ``reports/bench_models.json``.

``quick``: median seconds of quick commands over ``--repeat`` runs in a temporary project, against the 5 s budget:
``citer --help``, ``citer data validate FILE -f math`` on 10 rows (no flow, no tracking), and for the record the
``validate`` stage (a Prefect flow run and an MLflow run; its floor is Prefect's temporary server, unless
``PREFECT_API_URL`` names a running one). The rows: ``$CITER_SHARED_DATA/math/gsm8k_test.jsonl``'s first 10, else
synthesised. Writes ``reports/bench_cli.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
    """Seconds ``cmd`` took in ``cwd`` with this interpreter's tools and without the ``drop`` variables; exits on
    failure."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
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
        busy = subprocess.Popen(
            [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(args.nice)
        )
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
            Path(os.environ.get("CITER_SHARED_DATA", ROOT.parent / "shared" / "data"))
            / "math"
            / "gsm8k_test.jsonl"
        )
        if shared.is_file():
            lines = shared.read_text(encoding="utf-8").splitlines(keepends=True)[:10]
        else:
            lines = [json.dumps({"problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. \\boxed{{{i + 1}}}"}) + "\n"
                     for i in range(10)]  # fmt: skip
        (proj / "ten.jsonl").write_text("".join(lines), encoding="utf-8")
        (proj / "params.yaml").write_text(
            "data: {format: math, train: ten.jsonl, dev: ten.jsonl, test: ten.jsonl}\n", encoding="utf-8"
        )
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


def models(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from citer.config import load_params
    from citer.data.synth import synthesize, write_splits
    from citer.models.bootstrap import bootstrap_models
    from citer.models.evaluate import evaluate_model
    from citer.models.finetune import finetune_slm
    from citer.models.loading import count_params, load_model

    params, fmt, phases, cpu = load_params(args.params), "math", {}, {}

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.process_time()
        yield
        phases[name], cpu[name] = time.perf_counter() - t, time.process_time() - c

    with contextlib.ExitStack() as stack:
        work = Path(args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="citer-bench-")))
        with phase("synth"):
            splits = synthesize(params.synth)
            write_splits(work / "data", splits)
        with phase("bootstrap"):
            boot = bootstrap_models(
                params.bootstrap, work / "data", work / "models/slm_base", work / "models/llm"
            )
        with phase("finetune"):
            ft = finetune_slm(work / "models/slm_base", splits[f"{fmt}_train"], fmt, params.finetune, work / "models/slm",
                              eval_rows=None)  # fmt: skip
        test = splits[f"{fmt}_test"][: params.eval.n_examples or None]
        acc, n = {}, {}
        with phase("eval"):
            for name in ("slm_base", "slm", "llm"):
                model, tok = load_model(work / "models" / name)
                ev = evaluate_model(model, tok, test, fmt, params.eval.batch_size, params.eval.max_new_tokens)
                acc[name], n[name] = ev.accuracy, count_params(model)
    for d in (phases, cpu):
        d["bootstrap_plus_finetune"] = d["bootstrap"] + d["finetune"]
    return {"seconds": phases, "cpu_seconds": cpu, "params": {"slm": n["slm"], "llm": n["llm"], "ratio": n["llm"] / n["slm"]},
            "test_accuracy": acc, "n_test": len(test), "slm_pretrain_seconds": boot["slm_pretrain_seconds"],
            "llm_pretrain_seconds": boot["llm_pretrain_seconds"], "finetune_steps": ft.steps,
            "finetune_loss": ft.train_loss, "cpu_count": os.cpu_count(), "loadavg_1m_at_end": os.getloadavg()[0]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="bench", required=True)
    rp = sub.add_parser("repro", help="the pipeline from a fresh clone, quiet and with one core busy")
    rp.add_argument("--command", choices=("dvc", "pipeline"), default="dvc")
    rp.add_argument("--modes", default="quiet,loaded", help="comma-separated: quiet, loaded")
    rp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    rp.add_argument("--nice", type=int, default=0)
    rp.add_argument("--out", default=str(ROOT / "reports" / "bench_load.json"))
    mp = sub.add_parser("models", help="the embedded model stages in this process")
    mp.add_argument("--params", default=str(ROOT / "params.yaml"))
    mp.add_argument("--work", help="directory for data/ and models/ (default: a temporary one)")
    mp.add_argument("--out", default=str(ROOT / "reports" / "bench_models.json"))
    qp = sub.add_parser("quick", help="quick commands against the 5 s budget")
    qp.add_argument("--repeat", type=int, default=3)
    qp.add_argument("--out", default=str(ROOT / "reports" / "bench_cli.json"))
    args = ap.parse_args()
    started = time.perf_counter()
    out = {"repro": repro, "models": models, "quick": quick}[args.bench](args)
    write_json(Path(args.out), out)
    name = {"repro": "load", "models": "bootstrap", "quick": "cli"}[args.bench]  # the names their reports had
    stamp_bench(args.out, name, args, time.perf_counter() - started)
    if args.bench == "models":
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
