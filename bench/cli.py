"""Wall time of quick ``citer`` commands against the 5 s budget: ``python bench/cli.py``.

Runs each command ``--repeat`` times (default 3) in a fresh temporary project and prints the median seconds and its
ratio to the budget:

- ``citer --help``;
- ``citer data validate FILE -f math`` on a 10-row file (an ad-hoc check: no flow, no tracking);
- ``citer data validate`` as the project's stage (a Prefect flow run and an MLflow run) on 10-row splits, for the
  record: its floor is Prefect's temporary server, which starts in every process unless ``PREFECT_API_URL`` names a
  running one.

The 10 rows come from ``$CITER_SHARED_DATA/math/gsm8k_test.jsonl`` when present, else are synthesised. Writes
``reports/bench_cli.json`` (atomically).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from citer.ops.io import write_json  # noqa: E402

BUDGET_S = 5.0


def ten_rows(dst: Path) -> None:
    shared = (
        Path(os.environ.get("CITER_SHARED_DATA", ROOT.parent / "shared" / "data"))
        / "math"
        / "gsm8k_test.jsonl"
    )
    if shared.is_file():
        with shared.open(encoding="utf-8") as fh:
            lines = [next(fh) for _ in range(10)]
    else:
        lines = [json.dumps({"problem": f"{i} + 1?", "solution": f"{i} + 1 = {i + 1}. \\boxed{{{i + 1}}}"}) + "\n"
                 for i in range(10)]  # fmt: skip
    dst.write_text("".join(lines), encoding="utf-8")


def timed(cmd: list[str], cwd: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("CITER_ROOT", "MLFLOW_TRACKING_URI")}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-500:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_cli.json"))
    args = ap.parse_args()
    citer = shutil.which("citer") or str(Path(sys.executable).parent / "citer")
    results = []
    with tempfile.TemporaryDirectory(prefix="citer-bench-cli-") as tmp:
        proj = Path(tmp)
        ten_rows(proj / "ten.jsonl")
        (proj / "params.yaml").write_text(
            "data: {format: math, train: ten.jsonl, dev: ten.jsonl, test: ten.jsonl}\n", encoding="utf-8"
        )
        cases = {
            "citer --help": [citer, "--help"],
            "citer data validate ten.jsonl -f math": [citer, "data", "validate", "ten.jsonl", "-f", "math"],
            "citer data validate (stage: flow + MLflow run)": [citer, "data", "validate"],
        }
        for name, cmd in cases.items():
            times = [timed(cmd, proj) for _ in range(args.repeat)]
            med = statistics.median(times)
            results.append({"command": name, "median_s": round(med, 2), "runs_s": [round(t, 2) for t in times],
                            "ratio_to_budget": round(med / BUDGET_S, 2)})  # fmt: skip
            print(f"{name:<50} median {med:6.2f} s  ({med / BUDGET_S:.2f} x the {BUDGET_S:.0f} s budget)")
    write_json(Path(args.out), {"budget_s": BUDGET_S, "cpu_count": os.cpu_count(), "results": results})


if __name__ == "__main__":
    main()
