"""Time the embedded model stages end to end: synth -> bootstrap (tokenizer, SLM base, LLM) -> SLM finetune -> eval.

    python bench/bootstrap.py                      # params.yaml, scratch dir, writes reports/bench_models.json
    python bench/bootstrap.py --params p.yaml --work /tmp/citer-bench --out reports/bench_models.json

Runs in a scratch directory (the pipeline's data/ and models/ are left alone unless ``--work`` points there).
Timings on a shared 2-core machine are noisy; the report records the CPU count and load average beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from citer.config import Params, load_params  # noqa: E402
from citer.data.synth import synthesize, write_splits  # noqa: E402
from citer.io import write_json  # noqa: E402
from citer.models.bootstrap import bootstrap_models  # noqa: E402
from citer.models.evaluate import evaluate_model  # noqa: E402
from citer.models.finetune import finetune_slm  # noqa: E402
from citer.models.loading import count_params, load_model  # noqa: E402
from citer.provenance import stamp_bench  # noqa: E402


def run(params: Params, work: Path) -> dict:
    fmt, models = "math", work / "models"
    phases: dict[str, float] = {}
    cpu: dict[
        str, float
    ] = {}  # process CPU seconds: less sensitive than wall time to other jobs on the cores

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.process_time()
        yield
        phases[name], cpu[name] = time.perf_counter() - t, time.process_time() - c

    with phase("synth"):
        splits = synthesize(params.synth)
        write_splits(work / "data", splits)
    with phase("bootstrap"):
        boot = bootstrap_models(params.bootstrap, work / "data", models / "slm_base", models / "llm")
    with phase("finetune"):
        ft = finetune_slm(
            models / "slm_base", splits[f"{fmt}_train"], fmt, params.finetune, models / "slm", eval_rows=None
        )
    test = splits[f"{fmt}_test"][: params.eval.n_examples or None]
    acc, n_params = {}, {}
    with phase("eval"):
        for name in ("slm_base", "slm", "llm"):
            model, tok = load_model(models / name)
            ev = evaluate_model(model, tok, test, fmt, params.eval.batch_size, params.eval.max_new_tokens)
            acc[name], n_params[name] = ev.accuracy, count_params(model)
    for d in (phases, cpu):
        d["bootstrap_plus_finetune"] = d["bootstrap"] + d["finetune"]
    ratio = n_params["llm"] / n_params["slm"]
    return {"seconds": phases, "cpu_seconds": cpu, "params": {"slm": n_params["slm"], "llm": n_params["llm"], "ratio": ratio},
            "test_accuracy": acc, "n_test": len(test), "slm_pretrain_seconds": boot["slm_pretrain_seconds"],
            "llm_pretrain_seconds": boot["llm_pretrain_seconds"], "finetune_steps": ft.steps,
            "finetune_loss": ft.train_loss, "cpu_count": os.cpu_count(), "loadavg_1m_at_end": os.getloadavg()[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--work", default=None, help="directory for data/ and models/ (default: a temporary one)")
    ap.add_argument("--out", default="reports/bench_models.json")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    params = load_params(a.params)
    if a.work:
        report = run(params, Path(a.work))
    else:
        with tempfile.TemporaryDirectory(prefix="citer-bench-") as tmp:
            report = run(params, Path(tmp))
    write_json(a.out, report)
    stamp_bench(a.out, "bootstrap", a, time.perf_counter() - started)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
