"""Stages ``labels_iter{k}``: token-level preference labels (k = 1: ground-truth shortcut; k >= 2: routed rollouts)."""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="collect-labels", flow_run_name="collect labels, iteration {iteration}")
def collect(params_path: str, iteration: int) -> tuple[Any, int]:
    """One iteration's labels, its passes cut into shards that run as tasks on this flow's task runner (labels_flow
    picks it from ``runtime`` params). The driver loads no weights: workers load the pair once and keep it."""
    from citer.models.loading import load_tokenizer
    from citer.routing.iterations import pair_digests
    from citer.routing.label_store import load_labels
    from citer.routing.labels import collect_iter1, collect_iter_k, encode_rows, rows_hash
    from citer.routing.workers import ShardContext, release, slm_hidden_size
    from flows.runners import ShardedWork

    proj = load_project(params_path)
    p = proj.params
    tok = load_tokenizer(proj.slm_ref, p.models.trust_remote_code)
    rows = proj.read_split("train")
    hidden = slm_hidden_size(proj)
    prev = None
    if iteration > 1:
        prev = load_labels(proj.labels_dir(iteration - 1), expected_hidden_size=hidden)
    n = p.labels.n_examples if prev is None else int(prev.meta.get("n_examples", 0))
    ctx = ShardContext(
        root=str(proj.root),
        params=p,
        digests=pair_digests(proj.slm_ref, proj.llm_ref),
        rows_hash=rows_hash(encode_rows(tok, rows, p.data.format, n)),
        n_examples=n,
        router_iteration=iteration - 1,
    )
    work = ShardedWork(ctx, p.runtime, hidden, int(tok.eos_token_id))
    try:
        if prev is None:
            ls = collect_iter1(
                None, None, tok, rows, p.data.format, p.labels, slm_name=proj.slm_name, llm_name=p.models.llm,
                work=work,
            )  # fmt: skip
        else:
            ls = collect_iter_k(prev, None, None, None, tok, rows, p.data.format, p.labels, work=work)
    finally:
        if p.runtime.task_runner == "local":
            release()  # the local runner's workers are this process: keep no pair once collection is done
    return ls, hidden


@task(name="labels-fingerprint")
def labels_fingerprint(proj, iteration: int) -> str:
    """What iteration ``iteration``'s labels are made from (see citer.routing.iterations)."""
    from citer.ops.io import file_digest
    from citer.routing.iterations import (
        LABELS_CODE,
        dir_digest,
        fingerprint,
        model_fingerprint,
        recorded_fingerprint,
        source_digest,
    )
    from citer.routing.label_store import META_FILE
    from citer.routing.mlp import META_FILE as ROUTER_META
    from citer.routing.mlp import WEIGHTS_FILE

    p = proj.params
    parts = {
        "iteration": iteration,
        "slm": [proj.slm_name, model_fingerprint(proj.slm_ref)],
        "llm": [p.models.llm, model_fingerprint(proj.llm_ref)],
        "dtype": p.models.dtype,
        "train": file_digest(proj.path(p.data.train)),
        "format": p.data.format,
        "labels": p.labels.model_dump(exclude={"iterations"}),
        "code": source_digest(LABELS_CODE),
        "records": "pair_digests",  # label sets from before provenance was recorded are collected again
    }
    if iteration > 1:
        prev_router = proj.router_dir(iteration - 1)
        parts["previous_labels"] = recorded_fingerprint(proj.labels_dir(iteration - 1) / META_FILE)
        parts["previous_router"] = dir_digest(prev_router, (WEIGHTS_FILE, ROUTER_META))
    return fingerprint(parts)


@flow(name="collect-preferences")
@locked("labels")
def labels_flow(params_path: str = "params.yaml", iteration: int = 1, reuse: bool = False) -> dict[str, Any]:
    """Collect one iteration's labels; with ``reuse``, keep the label set on disk when its inputs are unchanged."""
    from citer.routing.iterations import pair_digests, recorded_fingerprint
    from citer.routing.label_store import META_FILE, save_labels, validate_labels

    proj = load_project(params_path)
    if not 1 <= iteration <= proj.params.labels.iterations:
        raise ValueError(
            f"labels.iterations is {proj.params.labels.iterations}; iteration {iteration} is out of range"
        )
    fp = labels_fingerprint(proj, iteration)
    out_dir = proj.labels_dir(iteration)
    if reuse and recorded_fingerprint(out_dir / META_FILE) == fp:
        return {"dir": str(out_dir), "reused": True, "fingerprint": fp}
    from flows.runners import TaskRunners

    runner = TaskRunners.build(proj.params.runtime)
    labelset, hidden = collect.with_options(task_runner=runner)(params_path, iteration)
    labelset.meta["fingerprint"] = fp
    labelset.meta.update(slm=proj.slm_name, llm=proj.params.models.llm)
    # provenance: a router trains only on its pair
    labelset.meta.update(pair_digests(proj.slm_ref, proj.llm_ref))
    report = validate_labels(labelset, hidden)
    out = save_labels(labelset, out_dir)
    counts = labelset.case_counts()
    with stage_run(proj, f"labels_iter{iteration}") as run:
        run.params(proj.params.labels.model_dump(), prefix="labels.")
        run.params(proj.params.runtime.model_dump(), prefix="runtime.")
        run.metrics({f"case.{k}": v for k, v in counts.items()} | {"n_tokens": labelset.n_tokens})
        run.metrics(
            {
                k: v
                for k, v in labelset.meta.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
        )
        run.metrics({f"labels.{k}": v for k, v in report.get("label_counts", {}).items()})
    return {"dir": str(out), "n_tokens": labelset.n_tokens, "case_counts": counts, "meta": labelset.meta}
