"""A router job: the same router whether it trains here or in a worker process beside another, refusals first."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import spawned_workers
from test_mlp import separable

from citer.config import RouterParams
from citer.ops.processes import run_jobs
from citer.routing.fitting import RouterJob, fit_router
from citer.routing.iterations import ProvenanceError
from citer.routing.label_store import save_labels
from citer.routing.mlp import RouterError, load_router

PAIR = {"slm_digest": "s" * 12, "llm_digest": "l" * 12}


def job(tmp_path, name: str, **router) -> RouterJob:
    return RouterJob(
        labels_dir=str(tmp_path / "labels"),
        labels_ref="labels",
        out_dir=str(tmp_path / name),
        router=RouterParams(**{"epochs": 4, "min_val_auc": 0.0, **router}).model_dump(),
        what=f"router {name}",
        pair=PAIR,
        slm_name="models/slm",
        llm_name="models/llm",
        fingerprint=f"fp-{name}",
    )


@pytest.fixture()
def labels_on_disk(tmp_path):
    ls = separable()
    ls.meta.update(PAIR)
    save_labels(ls, tmp_path / "labels")
    return tmp_path


def test_workers_write_the_routers_one_process_writes(labels_on_disk):
    tmp = labels_on_disk
    jobs = [job(tmp, "a"), job(tmp, "b", layers=[0.5], seed=3)]
    here = list(run_jobs(fit_router, jobs, processes=0))
    apart = [job(tmp, "a2"), job(tmp, "b2", layers=[0.5], seed=3)]
    workers = list(run_jobs(fit_router, apart, processes=2))
    assert [f.summary for f in here] == [f.summary for f in workers]
    assert [f.curves for f in here] == [f.curves for f in workers]
    for x, y in (("a", "a2"), ("b", "b2")):
        assert (tmp / x / "router.safetensors").read_bytes() == (tmp / y / "router.safetensors").read_bytes()
    router, meta = load_router(tmp / "b2")
    assert meta["fingerprint"] == "fp-b2" and meta["slm_digest"] == PAIR["slm_digest"]
    assert list(router.widths) != list(load_router(tmp / "a2")[0].widths)


def test_a_failing_job_raises_from_a_worker_and_writes_nothing(labels_on_disk):
    tmp = labels_on_disk
    jobs = [job(tmp, "ok"), job(tmp, "picky", min_val_auc=1.0)]
    results = run_jobs(fit_router, jobs, processes=2)
    assert next(results).summary["n_tokens"] > 0
    with pytest.raises(RouterError, match="router picky: validation AUC"):
        next(results)
    assert not (tmp / "picky").exists()
    assert spawned_workers() == []


def test_a_label_set_of_another_pair_is_refused(labels_on_disk):
    other = replace(job(labels_on_disk, "x"), pair={**PAIR, "slm_digest": "z" * 12})
    with pytest.raises(ProvenanceError, match="labels labels"):
        fit_router(other)
    assert not (labels_on_disk / "x").exists()
