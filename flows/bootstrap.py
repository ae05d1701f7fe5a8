"""Stage ``bootstrap_models`` (embedded default only): the SLM base and the LLM trained from scratch into
``models.slm`` and ``models.llm``. Disabled, it only checks that your models are there and never touches them."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="bootstrap-models")
@locked("bootstrap")
def bootstrap_flow(params_path: str = "params.yaml", finetune_alongside: bool = False) -> dict[str, Any]:
    """``finetune_alongside`` (``citer pipeline``): the SLM's finetune stage runs as soon as the SLM base is written,
    while the LLM still trains on the other worker; its summary comes back under ``finetune``."""
    import torch

    from citer.models.bootstrap import bootstrap_models
    from citer.ops.io import write_json
    from citer.ops.threads import job_processes
    from citer.tracking.provenance import write_results

    proj = load_project(params_path)
    p = proj.params
    report = proj.reports / "bootstrap.json"
    if not p.bootstrap.enabled:
        for key in ("slm", "llm"):
            ref = getattr(p.models, key)
            if not proj.path(ref).is_dir():
                raise FileNotFoundError(
                    f"bootstrap.enabled is false but models.{key}={ref} is not a directory ({proj.path(ref)}); "
                    f"put your model there or point models.{key} at it (DVC tracks local directories only)"
                )
        write_json(report, {"enabled": False, "slm": p.models.slm, "llm": p.models.llm})
        return {
            "disabled": f"bootstrap disabled (bootstrap.enabled: false): using your models, left untouched: "
            f"models.slm={p.models.slm}, models.llm={p.models.llm} (both present)"
        }
    # The two models side by side on runtime.workers processes when the stage runs one torch thread.
    processes = job_processes(p.runtime.workers, 2, torch.get_num_threads())
    finetuned: dict[str, Any] = {}
    after_slm = None
    if finetune_alongside and p.finetune.enabled:
        from flows.finetune_slm import finetune_flow

        def after_slm() -> None:
            finetuned["finetune"] = finetune_flow(params_path)

    metrics = bootstrap_models(
        p.bootstrap,
        proj.path(p.paths.data_dir),
        proj.path(p.models.slm),
        proj.path(p.models.llm),
        processes,
        after_slm,
    )
    write_results(report, metrics, stage="bootstrap")
    with stage_run(proj, "bootstrap_models") as run:
        run.params(p.bootstrap.model_dump(), prefix="bootstrap.")
        run.metrics({k: v for k, v in metrics.items() if not isinstance(v, dict)})
    return metrics | finetuned
