"""Scale-out for real: the labels flow on a local 2-worker Dask cluster and on a local Ray instance writes the labels
of the in-process run, byte for byte (tokens.parquet and hidden.safetensors), for iteration 1 (teacher-forced passes
and SLM rollouts) and, on Dask, iteration 2 (routed rollouts with the iteration-1 router).

One project, one Dask cluster and one Ray instance per module (Ray takes ~6 s to start on 2 cores); both are shut down
by their fixtures, so no worker process outlives the module.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, spread_router

pytestmark = pytest.mark.slow

FILES = ("tokens.parquet", "hidden.safetensors")
ITERATIONS = (1, 2)


@pytest.fixture(scope="module")
def scale_project(tiny_pair_dirs, tmp_path_factory):
    """A project with the tiny pair, a dozen train questions and a hand-made iteration-1 router; the current
    directory and CITER_ROOT point at it for the module."""
    from citer.routing.mlp import save_router

    root = tmp_path_factory.mktemp("scale")
    for role, src in zip(("slm", "llm"), tiny_pair_dirs, strict=True):
        shutil.copytree(src, root / "models" / role)
    (root / "data").mkdir()
    rows = [
        {"problem": f"{a}+{b}", "solution": f"{a}+{b}={a + b}. \\boxed{{{a + b}}}"}
        for a in range(2)
        for b in (4, 11, 25, 7)
    ]
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"].update(train="data/train.jsonl", dev="data/train.jsonl", test="data/train.jsonl")
    params["models"].update(slm="models/slm", llm="models/llm", finetuned_slm="models/slm")
    params["finetune"]["enabled"] = False
    params["labels"].update(
        iterations=2, n_examples=8, batch_size=4, max_new_tokens=4, rollout_llm_token=True
    )
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    from citer.routing.iterations import pair_digests

    # the pair it routes for: every router loader refuses one that does not record it
    meta = {"slm": "models/slm", "llm": "models/llm"} | pair_digests(
        root / "models" / "slm", root / "models" / "llm"
    )
    save_router(spread_router(32), root / "artifacts" / "routers" / "iter1", meta)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CITER_ROOT", str(root))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("CITER_PARENT_RUN_ID", raising=False)
        mp.chdir(root)
        yield root


def set_runtime(root: Path, **runtime) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["runtime"] = {"task_runner": "local", "workers": 1, "address": None, **runtime}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def label_files(d: Path, iterations: tuple[int, ...] = ITERATIONS) -> dict[str, bytes]:
    return {f"iter{k}/{f}": (d / f"iter{k}" / f).read_bytes() for k in iterations for f in FILES}


def collect_sharded(
    root: Path, out: Path, name: str, iterations: tuple[int, ...] = ITERATIONS
) -> dict[str, bytes]:
    """Both iterations through the ``collect-labels`` flow (the sharded part of the labels stage) on the runner the
    params name, saved to ``out``; iteration 2 reads the reference's iteration 1, which it must equal anyway."""
    from citer.project import load_project
    from citer.routing.label_store import save_labels
    from flows.collect_preferences import collect
    from flows.runners import TaskRunners

    t0 = time.perf_counter()
    for k in iterations:
        runner = TaskRunners.build(load_project().params.runtime)
        labelset, _ = collect.with_options(task_runner=runner)("params.yaml", k)
        assert labelset.meta["n_rollouts"] > 0  # the rollout shards ran
        save_labels(labelset, out / f"iter{k}")
    print(f"{name}: iterations {iterations} in {time.perf_counter() - t0:.1f} s")
    return label_files(out, iterations)


@pytest.fixture(scope="module")
def reference(prefect_server, scale_project):
    """The labels of the whole labels stage in process: one shard, one thread (what every runner must reproduce)."""
    from flows.collect_preferences import labels_flow

    set_runtime(scale_project)
    for k in ITERATIONS:
        assert labels_flow("params.yaml", iteration=k)["meta"]["n_rollouts"] > 0
    return label_files(scale_project / "artifacts" / "labels")


def assert_same(got: dict[str, bytes], want: dict[str, bytes]) -> None:
    for key in got:
        assert got[key] == want[key], f"{key} differs from the in-process run"


@pytest.fixture(scope="module")
def dask_cluster():
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        yield cluster
    finally:
        cluster.close()


def test_dask_two_workers_equal_in_process(reference, scale_project, dask_cluster, tmp_path):
    set_runtime(
        scale_project,
        task_runner="dask",
        workers=2,
        address=dask_cluster.scheduler_address,
        shards_per_worker=2,
    )
    assert_same(collect_sharded(scale_project, tmp_path, "dask, 2 workers"), reference)
    # Each worker loaded the pair once and kept it: its cache holds one pair, under the driver's digests.
    from distributed import Client

    with Client(dask_cluster.scheduler_address) as client:
        held = client.run(lambda: [k for k in __import__("citer.routing.workers").routing.workers._SLOTS])
    assert all(slots and "pair" in slots for slots in held.values()), held


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of 2 CPUs; the Ray runner finds it initialised and uses it (and leaves it running)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_two_workers_equal_in_process(reference, scale_project, ray_local, tmp_path):
    set_runtime(scale_project, task_runner="ray", workers=2)
    # Iteration 1 only: iteration 2's routed rollouts take the same task path, checked on Dask (Ray is slow to start).
    assert_same(collect_sharded(scale_project, tmp_path, "ray, 2 workers", (1,)), reference)
