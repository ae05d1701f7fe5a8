"""The whole CITER pipeline as one Prefect flow; each stage is a subflow and a nested MLflow run.

validate -> [embedded: synth, bootstrap] -> finetune SLM (in the embedded run: beside the LLM's pretraining, once the
SLM base is written) -> eval models -> labels 1 -> router 1 -> ... -> labels K
-> router K (+ CITER-S router) -> sweep and promote -> batch inference on data.test (or inference.input).

Disabled stages are skipped (their models or data are the user's, used as params name them); label sets and routers
whose inputs did not change since the last run are kept (flows/iterate.py).
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="citer-pipeline")
@locked("pipeline")
def pipeline_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from flows.batch_inference import batch_inference_flow
    from flows.bootstrap import bootstrap_flow
    from flows.evaluate_models import eval_models_flow
    from flows.finetune_slm import finetune_flow
    from flows.iterate import iterate_flow
    from flows.sweep_and_promote import sweep_flow
    from flows.synth import synth_flow
    from flows.validate import validate_flow

    proj = load_project(params_path)  # a bad params.yaml stops here, before any work
    p = proj.params
    out: dict[str, Any] = {}
    with stage_run(proj, "pipeline") as parent:
        previous = os.environ.get("CITER_PARENT_RUN_ID")
        os.environ["CITER_PARENT_RUN_ID"] = parent.run_id
        try:
            if p.synth.enabled:
                out["synth"] = synth_flow(params_path)
            reports = validate_flow(params_path)
            bad = [r["path"] for r in reports if not r["ok"]]
            if bad:
                raise ValueError(f"data validation failed for {bad}; see reports/validation.json")
            if p.bootstrap.enabled:  # the SLM's finetune runs in it, beside the LLM's pretraining
                out["bootstrap"] = bootstrap_flow(params_path, finetune_alongside=p.finetune.enabled)
                if "finetune" in out["bootstrap"]:
                    out["finetune"] = out["bootstrap"].pop("finetune")
            if p.finetune.enabled and "finetune" not in out:
                out["finetune"] = finetune_flow(params_path)
            out["models"] = eval_models_flow(params_path)
            out.update(iterate_flow(params_path))  # labels + router k = 1..labels.iterations, CITER-S
            out["sweep"] = sweep_flow(params_path)
            # Without a champion (the sweep promoted nothing) it writes an empty predictions file saying why.
            out["inference"] = batch_inference_flow(params_path)
            out["mlflow_run"] = parent.run_id
        finally:
            if previous is None:
                os.environ.pop("CITER_PARENT_RUN_ID", None)
            else:
                os.environ["CITER_PARENT_RUN_ID"] = previous
    return out
