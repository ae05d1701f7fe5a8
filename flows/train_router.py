"""Routers of the ``iterate`` stage (``citer router train``): the MLP router on a label set, best epoch kept.

Besides the routers of each iteration and CITER-S, ``router.ablations`` names extra routers on the last
iteration's labels that read more than the hidden state (``emb``: + the SLM's token embedding, ``logits``: + logit
statistics, ``emb_logits``: both), saved at ``routers_dir/ablation_{name}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, task

from citer.project import load_project
from citer.routing.fitting import FittedRouter, RouterJob, SlmRef
from flows.common import locked, stage_run


@task(name="router-fingerprint")
def router_fingerprint(proj, labels_dir, router_params=None) -> str:
    """What a router is made from: its label set (files and inputs), the router params and the code."""
    from citer.routing.iterations import (
        ROUTER_CODE,
        dir_digest,
        fingerprint,
        recorded_fingerprint,
        source_digest,
    )
    from citer.routing.label_store import HIDDEN_FILE, META_FILE, TOKENS_FILE

    rp = router_params if router_params is not None else proj.params.router
    parts = {
        "labels": recorded_fingerprint(labels_dir / META_FILE),  # covers the SLM whose head the features read
        "labels_files": dir_digest(labels_dir, (HIDDEN_FILE, TOKENS_FILE)),
        # Which ablations and widths exist changes no router; logit_k matters only to routers that read logit_stats.
        "router": rp.model_dump(exclude={"ablations", "logit_k", "layers_grid"}),
        "code": source_digest(ROUTER_CODE),
    }
    if "logit_stats" in rp.features:
        parts["logit_k"] = rp.logit_k
    return fingerprint(parts)


@task(name="router-report")
def router_report(proj, iterations: int) -> None:
    """``reports/router.json`` from the summaries the routers of iterations 1..K record in their meta."""
    from citer.ops.io import read_json
    from citer.routing.mlp import META_FILE, write_router_report

    done = []
    for k in range(1, iterations + 1):
        meta = read_json(proj.router_dir(k) / META_FILE)
        # Routers saved before summaries lived in their meta: the per-iteration report beside it.
        done.append(meta.get("summary") or read_json(proj.reports / f"router_iter{k}.json"))
    write_router_report(proj.reports / "router.json", done)


@dataclass(frozen=True)
class RouterTarget:
    """One router of the stage: the training job and where the flow records it."""

    job: RouterJob
    report_name: str  # reports/{report_name}.json and the MLflow run's name
    iteration: int
    last: bool  # the last iteration's CITER router: it also writes reports/router.json


@task(name="router-target")
def router_target(
    proj,
    iteration: int = 1,
    citer_s: bool = False,
    ablation: str | None = None,
    layers: list[float] | None = None,
) -> RouterTarget:
    """What to train for one router and where it goes (see :func:`router_flow` for the arguments)."""
    from citer.routing.architecture import layers_tag
    from citer.routing.features import ABLATIONS
    from citer.routing.iterations import pair_digests

    p = proj.params
    rp = p.router
    if ablation is not None:
        if ablation not in ABLATIONS:
            raise ValueError(f"router ablation {ablation!r} unknown; expected one of {sorted(ABLATIONS)}")
        rp = rp.model_copy(update={"features": list(ABLATIONS[ablation])})
        name: int | str = f"ablation_{ablation}"
        labels_dir = proj.labels_dir(p.labels.iterations)
    elif layers is not None:
        rp = rp.model_copy(update={"layers": [float(m) for m in layers]})
        name = f"layers_{layers_tag(layers)}"
        labels_dir = proj.labels_dir(p.labels.iterations)
    else:
        name = "citer_s" if citer_s else iteration
        labels_dir = proj.labels_dir(1 if citer_s else iteration)
    report_name = f"router_{name if isinstance(name, str) else f'iter{name}'}"
    m = p.models
    job = RouterJob(
        labels_dir=str(labels_dir),
        labels_ref=proj.portable_ref(labels_dir),
        out_dir=str(proj.router_dir(name)),
        router=rp.model_dump(),
        what=f"router {report_name}",
        pair=pair_digests(proj.slm_ref, proj.llm_ref),
        slm_name=proj.slm_name,
        llm_name=m.llm,
        fingerprint=router_fingerprint(proj, labels_dir, rp),
        citer_s=citer_s and ablation is None,
        slm=SlmRef(proj.slm_ref, m.dtype, m.device, m.trust_remote_code),
    )
    last = ablation is None and layers is None and not citer_s and iteration == p.labels.iterations
    return RouterTarget(job, report_name, iteration, last)


@task(name="router-kept")
def kept_router(proj, target: RouterTarget) -> dict[str, Any] | None:
    """The router on disk when its recorded fingerprint is the target's, with its report rewritten; else None.

    A router from before summaries were recorded, or one whose recorded pair is not the pair in use (the sweep would
    refuse it), is retrained."""
    from citer.ops.io import read_json, write_json
    from citer.routing.iterations import recorded_fingerprint
    from citer.routing.mlp import META_FILE
    from citer.routing.pair_check import pair_problem

    job = target.job
    meta_path = Path(job.out_dir) / META_FILE
    if recorded_fingerprint(meta_path) != job.fingerprint:
        return None
    kept = read_json(meta_path)
    summary = kept.get("summary")
    if summary is None or pair_problem(kept, job.pair, "router") is not None:
        return None
    write_json(proj.reports / f"{target.report_name}.json", summary)
    if target.last:
        router_report(proj, target.iteration)
    return {"dir": job.out_dir, "reused": True, **summary}


@task(name="router-record")
def record_router(proj, target: RouterTarget, fitted: FittedRouter) -> dict[str, Any]:
    """A trained router's report (and ``reports/router.json`` for the last iteration's) and its MLflow run."""
    from citer.ops.io import write_json

    write_json(proj.reports / f"{target.report_name}.json", fitted.summary)
    if target.last:
        router_report(proj, target.iteration)
    with stage_run(proj, target.report_name) as run:
        run.params(
            {k: v for k, v in target.job.router.items() if k not in ("ablations", "layers_grid")},
            prefix="router.",
        )
        run.metrics(fitted.scalars)
        for epoch, row in enumerate(fitted.curves):
            run.metrics({f"epoch.{k}": v for k, v in row.items() if k != "epoch"}, step=epoch)
        run.artifact(Path(target.job.out_dir), "router")
    return {"dir": target.job.out_dir, **fitted.summary}


@flow(name="train-router")
@locked("router")
def router_flow(
    params_path: str = "params.yaml",
    iteration: int = 1,
    citer_s: bool = False,
    reuse: bool = False,
    ablation: str | None = None,
    layers: list[float] | None = None,
) -> dict[str, Any]:
    """Train one router; with ``reuse``, keep the router on disk when its fingerprint is unchanged.

    ``ablation`` (a ``router.ablations`` name) trains that feature set on the last iteration's labels instead;
    ``layers`` (a ``router.layers_grid`` entry) the CITER router at those widths, at ``routers_dir/layers_{tag}``.
    """
    from citer.routing.fitting import fit_router

    proj = load_project(params_path)
    target = router_target(proj, iteration, citer_s, ablation, layers)
    if reuse and (kept := kept_router(proj, target)) is not None:
        return kept
    return record_router(proj, target, fit_router(target.job))


@flow(name="train-routers")
@locked("router")
def routers_flow(
    params_path: str = "params.yaml", specs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Train several routers that need nothing of one another (each spec holds :func:`router_flow`'s ``iteration``,
    ``citer_s``, ``ablation`` or ``layers``), keeping those whose fingerprint is unchanged; keyed by report name.

    The ones to train run side by side on ``runtime.workers`` processes of one torch thread when the stage runs one
    thread (:func:`citer.ops.threads.job_processes`), else here in order: the same routers either way. Results are
    recorded in the specs' order; the first router that fails stops the stage there."""
    import torch

    from citer.ops.processes import run_jobs
    from citer.ops.threads import job_processes
    from citer.routing.fitting import fit_router

    proj = load_project(params_path)
    targets = [router_target(proj, **spec) for spec in specs or []]
    out: dict[str, Any] = {}
    todo = []
    for target in targets:
        kept = kept_router(proj, target)
        if kept is not None:
            out[target.report_name] = kept
        else:
            todo.append(target)
    workers = job_processes(proj.params.runtime.workers, len(todo), torch.get_num_threads())
    for target, fitted in zip(todo, run_jobs(fit_router, [t.job for t in todo], workers), strict=True):
        out[target.report_name] = record_router(proj, target, fitted)
    return {t.report_name: out[t.report_name] for t in targets}
