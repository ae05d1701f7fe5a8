"""Routers of the ``iterate`` stage (``citer router train``): the MLP router on a label set, best epoch kept.

Besides the routers of each iteration and CITER-S, ``router.ablations`` names extra routers on the last
iteration's labels that read more than the hidden state (``emb``: + the SLM's token embedding, ``logits``: + logit
statistics, ``emb_logits``: both), saved at ``routers_dir/ablation_{name}``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from citer.project import load_project
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


@task(name="load-slm")
def load_slm(proj) -> tuple[Any, int]:
    """The SLM alone (its head and embedding feed router features) and the tokenizer's vocabulary size."""
    from citer.models.loading import load_model

    m = proj.params.models
    slm, tok = load_model(proj.slm_ref, m.dtype, m.device, m.trust_remote_code)
    return slm, len(tok)


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
    from citer.ops.io import write_json
    from citer.routing.architecture import layers_tag
    from citer.routing.features import ABLATIONS, needs_slm
    from citer.routing.iterations import check_provenance, pair_digests, recorded_fingerprint
    from citer.routing.label_store import load_labels
    from citer.routing.labels import citer_s_labels
    from citer.routing.mlp import (
        META_FILE,
        iteration_summary,
        require_quality,
        router_meta,
        save_router,
        train_router,
    )

    proj = load_project(params_path)
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
    out = proj.router_dir(name)
    fp = router_fingerprint(proj, labels_dir, rp)
    last = ablation is None and layers is None and not citer_s and iteration == p.labels.iterations
    pair = pair_digests(proj.slm_ref, proj.llm_ref)
    if reuse and recorded_fingerprint(out / META_FILE) == fp:
        from citer.ops.io import read_json
        from citer.routing.pair_check import pair_problem

        kept = read_json(out / META_FILE)
        summary = kept.get("summary")
        # A router from before summaries were recorded, or one whose recorded pair is not the pair in use (the
        # sweep would refuse it), is retrained.
        if summary is not None and pair_problem(kept, pair, "router") is None:
            write_json(proj.reports / f"{report_name}.json", summary)
            if last:
                router_report(proj, iteration)
            return {"dir": str(out), "reused": True, **summary}
    labelset = load_labels(labels_dir)
    check_provenance(labelset.meta, pair, f"labels {proj.portable_ref(labels_dir)}", ("slm", "llm"))
    if citer_s and ablation is None:
        labelset = citer_s_labels(labelset)
    slm, vocab = load_slm(proj) if needs_slm(rp.features) else (None, None)
    router, metrics = train_router(labelset, rp, slm=slm, vocab_size=vocab)
    require_quality(metrics, rp.min_val_auc, f"router {report_name}")
    summary = iteration_summary(labelset, metrics) | {"features": list(rp.features)}
    meta = router_meta(labelset, metrics, slm=proj.slm_name, llm=p.models.llm) | pair
    save_router(router, out, meta | {"fingerprint": fp, "summary": summary})
    write_json(proj.reports / f"{report_name}.json", summary)
    if last:
        router_report(proj, iteration)
    with stage_run(proj, report_name) as run:
        run.params(rp.model_dump(exclude={"ablations", "layers_grid"}), prefix="router.")
        run.metrics(metrics.scalars())
        for epoch, row in enumerate(metrics.curves):
            run.metrics({f"epoch.{k}": v for k, v in row.items() if k != "epoch"}, step=epoch)
        run.artifact(out, "router")
    return {"dir": str(out), **summary}
