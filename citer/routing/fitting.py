"""One router from its label set on disk to its directory: the unit of work of the ``iterate`` stage.

A :class:`RouterJob` is plain data (paths, params, names), so the same call runs in the stage's process or in a
worker process beside another router (:func:`citer.ops.processes.run_jobs`) and writes the same router either way.
The flow keeps the bookkeeping (reuse, reports, MLflow) and hands this module only the training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from citer.config import RouterParams


@dataclass(frozen=True)
class SlmRef:
    """Where the SLM whose head and embedding compute a router's extra features is, and how to load it."""

    ref: str
    dtype: str
    device: str | dict[str, Any]
    trust_remote_code: bool


@dataclass(frozen=True)
class RouterJob:
    labels_dir: str  # the label set (absolute)
    labels_ref: str  # the same, as errors name it (relative to the project)
    out_dir: str  # the router's directory, written atomically
    router: dict[str, Any]  # RouterParams fields (features, layers, ... of this router)
    what: str  # the router's name in errors: "router router_iter2"
    pair: dict[str, str]  # slm_digest / llm_digest of the pair in use: the label set must record these
    slm_name: str  # the pair's names, recorded in router.json
    llm_name: str
    fingerprint: str  # what the router is made from (the flow's reuse check)
    citer_s: bool = False  # train on the CITER-S relabelling of the label set
    slm: SlmRef | None = None  # required when the features read the SLM


@dataclass(frozen=True)
class FittedRouter:
    summary: dict[str, Any]  # what reports/router_*.json holds
    scalars: dict[str, float]  # the best epoch's metrics
    curves: list[dict[str, float]]  # one row per epoch


def fit_router(job: RouterJob) -> FittedRouter:
    """Train the router ``job`` describes and save it to ``job.out_dir``; refuses a label set made with another
    pair and a router below ``min_val_auc`` (nothing written)."""
    from citer.routing.features import needs_slm
    from citer.routing.iterations import check_provenance
    from citer.routing.label_store import load_labels
    from citer.routing.labels import citer_s_labels
    from citer.routing.mlp import iteration_summary, require_quality, router_meta, save_router, train_router

    rp = RouterParams(**job.router)
    labelset = load_labels(job.labels_dir)
    check_provenance(labelset.meta, job.pair, f"labels {job.labels_ref}", ("slm", "llm"))
    if job.citer_s:
        labelset = citer_s_labels(labelset)
    slm, vocab = None, None
    if needs_slm(rp.features):
        if job.slm is None:
            raise ValueError(f"{job.what}: features {list(rp.features)} read the SLM; the job names none")
        from citer.models.loading import load_model

        slm, tok = load_model(job.slm.ref, job.slm.dtype, job.slm.device, job.slm.trust_remote_code)
        vocab = len(tok)
    router, metrics = train_router(labelset, rp, slm=slm, vocab_size=vocab)
    require_quality(metrics, rp.min_val_auc, job.what)
    summary = iteration_summary(labelset, metrics) | {"features": list(rp.features)}
    meta = router_meta(labelset, metrics, slm=job.slm_name, llm=job.llm_name) | job.pair
    save_router(router, job.out_dir, meta | {"fingerprint": job.fingerprint, "summary": summary})
    return FittedRouter(summary, metrics.scalars(), metrics.curves)
