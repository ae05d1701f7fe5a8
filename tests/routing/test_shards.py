"""Shard splitting and merging (citer.routing.shards), the runtime params block and the worker cache.

The equality tests run the shards in this process on the tiny pair: sharded teacher-forced passes, rollouts and a
whole iteration-1 collection must give the single process's tensors bit for bit. The Prefect/Dask/Ray path of the same
shards is tests/e2e/test_scale_out.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import spread_router

from citer.config import ConfigError, LabelsParams, RuntimeParams, load_params
from citer.routing.labels import Branch, InProcessWork, collect_iter1, collect_iter_k, encode_rows
from citer.routing.rollouts import rollout_correct
from citer.routing.shards import (
    ShardError,
    batches_of,
    branches_from,
    branches_tensor,
    merge_by_index,
    merge_rollouts,
    merge_teacher_forced,
    rollout_shards,
    run_teacher_forced_shard,
    split_batches,
    teacher_forced_shards,
)

ROWS = [
    {"problem": f"{a}+{b}", "solution": f"{a}+{b}={a + b}. \\boxed{{{a + b}}}"}
    for a, b in [(3, 5), (12, 7), (1, 1), (40, 2), (9, 9), (7, 13), (2, 30), (5, 5), (21, 4)]
]


# ---------------------------------------------------------------------------------------------------------------
# Pure splitting and merging


@pytest.mark.parametrize(
    "n,batch,shards", [(10, 3, 2), (10, 3, 4), (10, 3, 9), (7, 7, 3), (1, 4, 2), (12, 2, 5)]
)
def test_split_batches_is_contiguous_whole_batches_balanced(n, batch, shards):
    order = list(range(n))[::-1]  # any order: shards follow it
    parts = split_batches(order, batch, shards)
    assert [i for p in parts for i in p] == order  # contiguous, in order, every item once
    whole = batches_of(order, batch)
    assert len(parts) == min(shards, len(whole)) and all(parts)
    counts, pos = [], 0
    for p in parts:  # each shard is a run of whole batches of the single-process order
        k = 0
        while sum(len(b) for b in whole[pos : pos + k]) < len(p):
            k += 1
        assert [i for b in whole[pos : pos + k] for i in b] == p
        counts.append(k)
        pos += k
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_split_edge_cases():
    assert split_batches([], 4, 3) == []
    with pytest.raises(ShardError, match="n_shards"):
        split_batches([1], 1, 0)
    with pytest.raises(ShardError, match="batch_size"):
        batches_of([1], 0)


def test_merge_by_index_round_trip_and_refusals():
    shards = [[2, 0], [3], [1]]
    assert merge_by_index(4, shards, [["c", "a"], ["d"], ["b"]]) == ["a", "b", "c", "d"]
    with pytest.raises(ShardError, match="in no shard"):
        merge_by_index(5, shards, [["c", "a"], ["d"], ["b"]])
    with pytest.raises(ShardError, match="twice"):
        merge_by_index(4, [[0, 0], [1, 2, 3]], [["a", "a"], ["b", "c", "d"]])
    with pytest.raises(ShardError, match="returned 1 results for 2"):
        merge_by_index(4, shards, [["c"], ["d"], ["b"]])
    with pytest.raises(ShardError, match="3 shards"):
        merge_by_index(4, shards, [["c", "a"]])


def test_branches_travel_as_a_tensor():
    br = [Branch(0, 3, 17), Branch(5, 0, 1)]
    t = branches_tensor(br)
    assert t.shape == (2, 3) and t.dtype == torch.long and branches_from(t) == br
    assert branches_tensor([]).shape == (0, 3)


# ---------------------------------------------------------------------------------------------------------------
# Sharded passes equal the single process, bit for bit


@pytest.fixture(scope="module")
def work(tiny_pair):
    slm, llm, tok = tiny_pair
    return InProcessWork(slm, llm, tok, ROWS, "math", spread_router(32), 0.5)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("n_shards", [2, 3, 5])
def test_sharded_teacher_forced_is_bitwise_the_single_pass(work, n_shards):
    enc = encode_rows(work.tokenizer, ROWS, "math")
    whole = work.teacher_forced(enc, 2)
    shards = teacher_forced_shards(enc, 2, n_shards)
    assert len(shards) == n_shards
    parts = [run_teacher_forced_shard(work, enc, ids, 2, torch.float32) for ids in shards[::-1]][
        ::-1
    ]  # any order
    merged = merge_teacher_forced(enc, shards, parts)
    for f in ("example_index", "position", "ref", "slm_token", "llm_token", "hidden"):
        assert _same(getattr(merged, f), getattr(whole, f)), f


class RecordingEngine:
    """Stands in for the routed engine: records every batch of prompts and writes a token that depends on it."""

    def __init__(self, slm):
        self.slm, self.llm, self.batches = slm, None, []

    def generate_batch(self, prompts, max_new_tokens, temperature):
        self.batches.append([tuple(p) for p in prompts])
        return type("R", (), {"tokens": [[p[-1]] for p in prompts]})()


def _branches(enc, eos):
    out = [
        Branch(e, p, (e * 7 + p) % 50 + 3) for e in range(len(enc)) for p in range(0, len(enc[e].target), 3)
    ]
    return out + [Branch(1, 2, eos), Branch(4, 0, eos)]  # EOS branches decode nothing


def test_rollout_shards_rebuild_the_single_process_batches(work):
    """The coupling to rollout_correct's batching order, pinned: shards see exactly the batches the single call does."""
    tok = work.tokenizer
    enc = encode_rows(tok, ROWS, "math")
    br = _branches(enc, tok.eos_token_id)
    whole_engine = RecordingEngine(work.slm)
    whole = rollout_correct(whole_engine, tok, enc, ROWS, "math", br, 4, 3)
    shards = rollout_shards(enc, br, tok.eos_token_id, 4, 3)
    engine = RecordingEngine(work.slm)
    parts = [rollout_correct(engine, tok, enc, ROWS, "math", [br[j] for j in ids], 4, 3) for ids in shards]
    assert engine.batches == whole_engine.batches
    assert merge_rollouts(len(br), shards, parts) == whole


def test_sharded_routed_rollouts_equal_the_single_process(work):
    tok = work.tokenizer
    enc = encode_rows(tok, ROWS, "math")
    br = _branches(enc, tok.eos_token_id)[::4]
    whole = work.rollouts(enc, br, True, 3, 4)
    shards = rollout_shards(enc, br, tok.eos_token_id, 3, 4)
    parts = [work.rollouts(enc, [br[j] for j in ids], True, 3, 4) for ids in shards]
    assert merge_rollouts(len(br), shards, parts) == whole


class ShardedInProcess:
    """ShardedWork (flows/runners.py) without Prefect: the same plan and merge, shards run here, last first."""

    def __init__(self, work, n_shards):
        self.work, self.n = work, n_shards
        self.hidden_size = work.hidden_size

    def teacher_forced(self, encoded, batch_size):
        shards = teacher_forced_shards(encoded, batch_size, self.n)
        parts = [
            run_teacher_forced_shard(self.work, encoded, ids, batch_size, torch.float16) for ids in shards
        ]
        return merge_teacher_forced(encoded, shards, parts)

    def rollouts(self, encoded, branches, routed, batch, max_new):
        eos = self.work.tokenizer.eos_token_id
        shards = rollout_shards(encoded, branches, eos, batch, self.n)
        parts = [
            self.work.rollouts(encoded, [branches[j] for j in s], routed, batch, max_new) for s in shards
        ]
        return merge_rollouts(len(branches), shards, parts)


def test_collect_iter1_and_k_sharded_equal_single_process(work, tmp_path):
    from citer.routing.label_store import HIDDEN_FILE, TOKENS_FILE, save_labels

    slm, llm, tok = work.slm, work.llm, work.tokenizer
    params = LabelsParams(n_examples=5, batch_size=2, max_new_tokens=3, rollout_llm_token=True)
    one = collect_iter1(slm, llm, tok, ROWS, "math", params)
    many = collect_iter1(
        None, None, tok, ROWS, "math", params, slm_name="", llm_name="", work=ShardedInProcess(work, 3)
    )
    assert one.meta["n_rollouts"] > 0
    save_labels(one, tmp_path / "one")
    save_labels(many, tmp_path / "many")
    for f in (HIDDEN_FILE, TOKENS_FILE):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "many" / f).read_bytes(), f
    k_one = collect_iter_k(one, work.router, slm, llm, tok, ROWS, "math", params)
    k_many = collect_iter_k(one, None, None, None, tok, ROWS, "math", params, work=ShardedInProcess(work, 4))
    assert k_one.tokens.equals(k_many.tokens) and k_one.meta == k_many.meta


# ---------------------------------------------------------------------------------------------------------------
# The runtime params block


def _params(tmp_path, runtime: str):
    p = tmp_path / "params.yaml"
    p.write_text(f"runtime: {runtime}\n")
    return load_params(p)


def test_runtime_defaults_and_shards():
    rt = RuntimeParams()
    assert (rt.task_runner, rt.workers, rt.address, rt.n_shards) == ("local", 1, None, 1)
    assert RuntimeParams(task_runner="dask", workers=4, shards_per_worker=3).n_shards == 12


@pytest.mark.parametrize(
    "runtime,message",
    [
        ("{workers: 0}", "runtime.workers: 0 is not allowed (must be >= 1 and <= 1024)"),
        (
            "{task_runner: spark}",
            "runtime.task_runner: 'spark' is not allowed (must be 'local', 'dask' or 'ray')",
        ),
        ("{address: 'tcp://h:8786'}", "runtime.address: 'tcp://h:8786' is not allowed (must be null when"),
        (
            "{task_runner: dask, address: 'no such'}",
            "runtime.address: 'no such' is not allowed (must be scheme",
        ),
        (
            "{gpus_per_worker: 2}",
            "runtime.gpus_per_worker: 2 is not allowed (must be 0 when task_runner is local",
        ),
        (
            "{task_runner: ray, shards_per_worker: 65}",
            "runtime.shards_per_worker: 65 is not allowed (must be >= 1",
        ),
    ],
)
def test_runtime_errors_name_key_value_and_range(tmp_path, runtime, message):
    with pytest.raises(ConfigError) as err:
        _params(tmp_path, runtime)
    assert message in str(err.value)


def test_runtime_addresses_accepted(tmp_path, monkeypatch):
    monkeypatch.delenv("CITER_RUNTIME", raising=False)  # it would override the file
    for runner, address in (("dask", "tcp://10.0.0.5:8786"), ("ray", "auto"), ("ray", "ray://head:10001"),
                            ("ray", "head:6379")):  # fmt: skip
        rt = _params(tmp_path, f"{{task_runner: {runner}, address: '{address}'}}").runtime
        assert (rt.task_runner, rt.address) == (runner, address)


# ---------------------------------------------------------------------------------------------------------------
# The worker cache and the runner factory


def test_worker_cache_loads_once_and_keeps_one_value():
    from citer.routing import workers

    calls = []
    workers.release()
    try:
        assert workers._cached("t", "a", lambda: calls.append("a") or 1) == 1
        assert workers._cached("t", "a", lambda: calls.append("a2") or 2) == 1
        assert workers._cached("t", "b", lambda: calls.append("b") or 3) == 3
        assert calls == ["a", "b"] and [k for k, _ in workers._SLOTS.values()] == ["b"]
    finally:
        workers.release()
    assert workers.gpu_group(1, 2) == "2,3" and workers.gpu_group(0, 1) == "0"


def test_task_runner_factory():
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner
    from prefect_ray import RayTaskRunner

    from flows.runners import TaskRunners, WorkerShape

    local = TaskRunners.build(RuntimeParams(workers=3))
    # prefect 3 (pinned) keeps the pool size only in a private attribute.
    assert isinstance(local, ThreadPoolTaskRunner) and local._max_workers == 3
    dask_local = TaskRunners.build(RuntimeParams(task_runner="dask", workers=4, gpus_per_worker=2))
    assert isinstance(dask_local, DaskTaskRunner) and dask_local.address is None
    assert dask_local.cluster_kwargs == {
        "n_workers": 4,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
        "memory_limit": 0,
        "resources": {"GPU": 2},
    }
    remote = TaskRunners.build(RuntimeParams(task_runner="dask", address="tcp://s:8786"))
    assert (
        isinstance(remote, DaskTaskRunner)
        and remote.address == "tcp://s:8786"
        and remote.cluster_kwargs == {}
    )
    ray = TaskRunners.build(RuntimeParams(task_runner="ray", address="ray://h:10001"))
    assert isinstance(ray, RayTaskRunner) and ray.address == "ray://h:10001"
    # prefect-ray adds its namespace to the init arguments it is given.
    quiet = {"include_dashboard": False, "log_to_driver": False, "namespace": "prefect"}
    assert ray.init_kwargs == quiet
    assert TaskRunners.build(RuntimeParams(task_runner="ray", workers=2)).init_kwargs == quiet | {
        "num_cpus": 2
    }
    assert WorkerShape.of(RuntimeParams()) == WorkerShape()  # local: the driver's threads are left alone
    assert WorkerShape.of(RuntimeParams(task_runner="dask", gpus_per_worker=2)) == WorkerShape(1, 2, True)
    assert WorkerShape.of(RuntimeParams(task_runner="dask", address="tcp://s:8786", gpus_per_worker=2)) == (
        WorkerShape(1, 2, False)
    )
