"""What 8 and 4 bits cost in accuracy: the sweep once per llama.cpp type on the pipeline's own pair,
``python bench/precision_sweep.py --project DIR``.

``DIR`` is a project whose pipeline has run (``dvc repro``: its models, labels and routers). For each of ``--types``
(F32, then the block-32 types Q8_0 and Q4_0: the embedded models' widths are not multiples of 256, which K-quants
need) the sweep decodes every pass on llama.cpp with ``engine.runner: llama_cpp`` at that type
(:func:`citer.evaluation.sweep.run_sweep`: each method's point chosen on dev by the params' rule, reported on test
with 95% intervals), F32 being full precision on the same runner, so a row's difference from it is the quantization's.
The grid is the sweep's protocol on fewer points, so three precisions fit in minutes on two cores (llama.cpp decodes
the tiny embedded models slower than the torch engine: its calls cost more than their arithmetic): the last
iteration's CITER router, the SLM's confidence, random routing and the params' verified methods at ``--fractions``, no
champion (it promotes nothing), no router ablations, widths or query router. Not a DVC stage: a bench of the method
across precisions. Writes ``reports/bench_precision_sweep.json`` (``--out``), stamped in ``reports/provenance.json``;
docs/results.md renders it (``citer report docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed_report import write_report  # noqa: E402

from citer.config.serving import EngineParams  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402


def chosen_rows(result: Any, sweep_params: Any) -> list[dict[str, Any]]:
    """Each method at its dev-chosen point (rows without τ: their one point) on test, with 95% intervals: the rows
    the sweep's own report keeps (``reports/sweep.json``'s ``selected_on_dev``)."""
    from citer.evaluation.report import write_sweep_reports

    with tempfile.TemporaryDirectory(prefix="citer_precision_") as d:
        write_sweep_reports(d, result, sweep_params)
        rows = json.loads((Path(d) / "sweep.json").read_text())
    keep = ("method", "tau", "accuracy", "accuracy_ci", "llm_token_fraction", "bytes_moved_rel_llm", "bytes_ci",
            "n_examples")  # fmt: skip
    # the oracle is a bound on routing (it knows the SLM's mistakes), not a method a user could choose: left out
    return [{k: r.get(k) for k in keep} for r in rows
            if r["method"] != "oracle" and (r.get("tau") is None or r.get("selected_on_dev"))]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--project", default=".", help="a project directory whose pipeline has run")
    p.add_argument("--types", default="F32,Q8_0,Q4_0")
    p.add_argument(
        "--fractions", default="0.02,0.05,0.1,0.2,0.3", help="the LLM-token fractions of each method"
    )
    p.add_argument("--out", default=str(ROOT / "reports" / "bench_precision_sweep.json"))
    a = p.parse_args(argv)
    from citer.decoding.llama_cpp_runner import missing

    if why := missing():
        print(f"precision_sweep: {why}", file=sys.stderr)
        return 2
    from citer.evaluation.sweep import run_sweep
    from citer.project import load_project
    from citer.routing.iterations import pair_digests
    from flows.sweep_and_promote import sweep_routers

    t0 = time.time()
    out_path = Path(a.out).resolve()
    os.chdir(a.project)  # the project's relative paths (models, routers, data) are its root's
    proj = load_project("params.yaml")
    prm = proj.params
    slm, llm, tok = proj.load_pair()
    pair = pair_digests(proj.slm_ref, proj.llm_ref)
    routers, _ = sweep_routers.fn(proj, slm, len(tok), pair)
    fractions = [float(f) for f in a.fractions.split(",")]
    sweep = prm.sweep.model_copy(update={"llm_fractions": fractions, "speculative": False})
    out: dict[str, Any] = {}
    methods = ["llm", "slm", "citer", "confidence"]
    for t in [x.strip() for x in a.types.split(",") if x.strip()]:
        t1 = time.time()
        result = run_sweep(slm, llm, tok, proj.read_split("dev"), proj.read_split("test"), prm.data.format,
                           {"citer": routers["citer"]}, sweep,
                           engine=EngineParams(runner="llama_cpp", llama_cpp_type=t))  # fmt: skip
        rows = chosen_rows(result, sweep)
        # a method with no dev point that meets the rule has no chosen row: say so rather than drop it
        rows += [
            {"method": m, "no_point_meets_rule": True}
            for m in methods
            if m not in {r["method"] for r in rows}
        ]
        out[t] = {"rows": rows, "seconds": round(time.time() - t1, 1),
                  "notes": {k: v for k, v in result.notes.items() if k in ("verify", "dev_examples", "test_examples")}}  # fmt: skip
        acc = {r["method"]: round(r["accuracy"], 3) if "accuracy" in r else None for r in out[t]["rows"]}
        print(f"{t}: {acc} ({out[t]['seconds']} s)", flush=True)
    report = {
        "bench": "precision_sweep",
        "pair": {"slm": proj.slm_name, "llm": prm.models.llm},
        "rule": prm.sweep.rule.model_dump(),
        "fractions": fractions,
        "types": out,
        "cpu": cpu_kind(),
        "elapsed_s": round(time.time() - t0, 1),
    }
    write_report(out_path, report, "precision_sweep", {"types": a.types}, time.time() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
