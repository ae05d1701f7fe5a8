"""Label collection's shards as Prefect tasks, on the task runner ``runtime`` params choose.

``runtime.task_runner``: ``local`` (Prefect's thread pool in this process), ``dask`` (prefect-dask: a local cluster
of ``runtime.workers`` processes, or the scheduler at ``runtime.address``) or ``ray`` (prefect-ray: a local Ray
instance, or the cluster at ``runtime.address``). :class:`ShardedWork` cuts the teacher-forced passes and the
rollouts into shards of whole batches (:mod:`citer.routing.shards`), submits one task per shard and merges the
results in shard order, so every runner yields the labels of the single process, byte for byte.

The layout rule keeps plain functions out of flow modules (``scripts/check_layout.py``), so the runner factory and
the worker set-up are methods of small classes here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from citer.config import RuntimeParams
from citer.evaluation.plan import (
    PassBench,
    PassOutcome,
    PassSpec,
    deal,
    gather,
    run_chunk,
    run_in_order,
    run_part,
)
from citer.ops.processes import JobPool
from citer.ops.threads import job_processes
from citer.routing.labels import Branch, Encoded, TeacherForced
from citer.routing.shards import (
    branches_tensor,
    merge_rollouts,
    merge_teacher_forced,
    rollout_shards,
    teacher_forced_shards,
)
from citer.routing.workers import (
    ShardContext,
    configure_worker,
    gpu_group,
    rollout_shard,
    teacher_forced_shard,
)

_INSTALL_RAY = "pip install -c constraints.txt -e '.[ray]'"


class TaskRunners:
    """The Prefect task runner ``runtime`` params describe."""

    @staticmethod
    def build(rt: RuntimeParams) -> TaskRunner:
        if rt.task_runner == "local":
            return ThreadPoolTaskRunner(max_workers=rt.workers)
        if rt.task_runner == "dask":
            from prefect_dask import DaskTaskRunner

            if rt.address:
                return DaskTaskRunner(address=rt.address)
            cluster: dict[str, Any] = {
                "n_workers": rt.workers,
                "threads_per_worker": 1,  # one shard at a time per worker: its one pair is never shared
                "processes": True,
                "dashboard_address": None,
                # A worker holds a whole model: Dask's default share of RAM would have its nanny kill it mid-load.
                "memory_limit": 0,
            }
            if rt.gpus_per_worker:
                cluster["resources"] = {"GPU": rt.gpus_per_worker}
            return DaskTaskRunner(cluster_kwargs=cluster)
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as exc:
            raise RuntimeError(
                f"runtime.task_runner: ray needs prefect-ray and ray ({_INSTALL_RAY})"
            ) from exc
        init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if rt.address:
            return RayTaskRunner(address=rt.address, init_kwargs=init)
        init["num_cpus"] = rt.workers * max(rt.threads_per_worker, 1)
        return RayTaskRunner(init_kwargs=init)


@dataclass(frozen=True)
class WorkerShape:
    """How a shard task sets up the worker it lands on (torch threads, GPUs)."""

    threads: int = 0  # 0: leave torch's threads (the local runner's threads share the driver's setting)
    gpus_per_worker: int = 0
    pin_local_dask: bool = False  # a local Dask cluster's workers see every GPU: give worker k its own group

    @classmethod
    def of(cls, rt: RuntimeParams) -> WorkerShape:
        if rt.task_runner == "local":
            return cls()
        pin = rt.task_runner == "dask" and rt.address is None and rt.gpus_per_worker > 0
        return cls(rt.threads_per_worker, rt.gpus_per_worker, pin)

    def apply(self) -> None:
        gpus = None
        if self.pin_local_dask:
            from distributed import get_worker

            # LocalCluster names workers 0..n-1
            gpus = gpu_group(int(get_worker().name), self.gpus_per_worker)
        configure_worker(self.threads, gpus)


class Placement:
    """Resources every task asks its runner for: CPUs (Ray) and GPUs per worker."""

    @staticmethod
    @contextlib.contextmanager
    def of(rt: RuntimeParams) -> Iterator[None]:
        if rt.task_runner == "ray":
            from prefect_ray.context import remote_options

            opts: dict[str, Any] = {"num_cpus": max(rt.threads_per_worker, 1)}
            if rt.gpus_per_worker:
                opts["num_gpus"] = rt.gpus_per_worker
            with remote_options(**opts):
                yield
        elif rt.task_runner == "dask" and rt.gpus_per_worker:
            import dask

            with dask.annotate(resources={"GPU": rt.gpus_per_worker}):
                yield
        else:
            yield


@task(name="labels-teacher-forced-shard", task_run_name="teacher-forced shard {index}", cache_policy=NO_CACHE)
def teacher_forced_task(
    ctx: ShardContext, index: int, ids: torch.Tensor, shape: WorkerShape
) -> dict[str, torch.Tensor]:
    """Shard ``index`` of the teacher-forced passes (``ids``: its examples, in batching order)."""
    shape.apply()
    return teacher_forced_shard(ctx, ids.tolist())


@task(name="labels-rollout-shard", task_run_name="rollout shard {index}", cache_policy=NO_CACHE)
def rollout_task(
    ctx: ShardContext, index: int, branches: torch.Tensor, routed: bool, shape: WorkerShape
) -> torch.Tensor:
    """Shard ``index`` of the rollouts (``branches``: (n, 3) in batching order) -> (n,) bool."""
    shape.apply()
    return rollout_shard(ctx, branches, routed)


@dataclass
class ShardedWork:
    """:class:`citer.routing.labels.LabelWork` as Prefect tasks on the running flow's task runner."""

    ctx: ShardContext
    rt: RuntimeParams
    hidden_size: int
    eos: int

    def teacher_forced(self, encoded: Sequence[Encoded], batch_size: int) -> TeacherForced:
        if batch_size != self.ctx.params.labels.batch_size:  # workers read it from ctx.params
            raise ValueError(
                f"sharded teacher-forced: batch_size {batch_size} differs from ctx's labels params"
            )
        shards = teacher_forced_shards(encoded, batch_size, self.rt.n_shards)
        shape = WorkerShape.of(self.rt)
        with Placement.of(self.rt):
            futures = [
                teacher_forced_task.submit(self.ctx, s, torch.tensor(ids, dtype=torch.long), shape)
                for s, ids in enumerate(shards)
            ]
        return merge_teacher_forced(encoded, shards, [f.result() for f in futures])

    def rollouts(
        self, encoded: Sequence[Encoded], branches: Sequence[Branch], routed: bool, batch: int, max_new: int
    ) -> list[bool]:
        labels = self.ctx.params.labels
        # workers read them from ctx.params
        if (batch, max_new) != (labels.batch_size, labels.max_new_tokens):
            raise ValueError(
                f"sharded rollouts: batch {batch}, max_new {max_new} differ from ctx's labels params"
            )
        shards = rollout_shards(encoded, branches, self.eos, batch, self.rt.n_shards)
        shape = WorkerShape.of(self.rt)
        with Placement.of(self.rt):
            futures = [
                rollout_task.submit(self.ctx, s, branches_tensor([branches[j] for j in ids]), routed, shape)
                for s, ids in enumerate(shards)
            ]
        return merge_rollouts(len(branches), shards, [f.result().tolist() for f in futures])


class DriverThreads:
    """Torch intra-op threads of the driver while passes run in it (one chunk, or the local runner's threads):
    ``runtime.threads_per_worker`` (0: leave them), restored after.

    The embedded pair's decode loops are overhead-bound: on 2 shared cores one torch thread decodes a sweep pass many
    times faster than two (which spin against each other and the machine's other work) and gives the same tokens."""

    @staticmethod
    @contextlib.contextmanager
    def of(rt: RuntimeParams) -> Iterator[None]:
        before = torch.get_num_threads()
        configure_worker(rt.threads_per_worker)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


@task(name="sweep-passes", task_run_name="sweep passes {index}", cache_policy=NO_CACHE)
def sweep_pass_task(
    bench: PassBench, specs: list[PassSpec], index: int, ids: list[int], shape: WorkerShape
) -> list[PassOutcome]:
    """Chunk ``index`` of a round of sweep passes (``ids``: indices into ``specs``)."""
    shape.apply()
    return run_chunk(bench, specs, ids)


@dataclass(frozen=True)
class SweepPasses:
    """:data:`citer.evaluation.plan.PassMap` as Prefect tasks on the running flow's task runner: the specs dealt into
    ``runtime.n_shards`` chunks, one task per chunk (each is sent the bench: the pair, the splits and the routers),
    outcomes gathered back in spec order. One chunk: the passes run here, in order, with no task. Passes that run
    in this process (one chunk, the local runner) do so with ``runtime.threads_per_worker`` torch threads.

    With ``pool`` (:meth:`local_processes`) the local runner's chunks go to worker processes instead of threads: a
    pass is many small torch calls, so threads of one process queue on the GIL; processes do not. Smaller chunks
    (:data:`CHUNKS_PER_PROCESS` per worker) keep both workers busy to the end of a round."""

    rt: RuntimeParams
    pool: JobPool | None = None

    CHUNKS_PER_PROCESS = 4

    @classmethod
    @contextlib.contextmanager
    def local_processes(cls, rt: RuntimeParams, *models: Any) -> Iterator[SweepPasses]:
        """The passes on ``runtime.workers`` processes of one thread when the local runner would use threads in a
        one-thread stage (:func:`citer.ops.threads.job_processes`), else as :class:`SweepPasses` maps them. Never
        where one of ``models`` (the pair the bench sends) is off the CPU: a worker process would be sent its CUDA
        tensors (each worker a CUDA context of its own, the weights copied through IPC) for a pair small enough to
        decode in one thread; its passes run in this process instead."""
        on_cpu = all(next(m.parameters()).device.type == "cpu" for m in models if m is not None)
        n = (
            job_processes(rt.workers, rt.n_shards, torch.get_num_threads())
            if rt.task_runner == "local" and on_cpu
            else 0
        )
        if n <= 1:
            yield cls(rt)
            return
        with JobPool(n) as pool:
            yield cls(rt, pool)

    def __call__(self, bench: PassBench, specs: list[PassSpec]) -> list[PassOutcome]:
        chunks = deal(len(specs), self.rt.n_shards)
        if len(chunks) <= 1:
            with DriverThreads.of(self.rt):
                return run_in_order(bench, specs)
        if self.pool is not None:
            # A speculative pass (the whole test split through assisted generation) costs many routed passes: it goes
            # first, alone, so the other workers share the rest instead of waiting for it at the end of the round.
            long = [i for i, s in enumerate(specs) if s.kind == "speculative"]
            rest = [i for i, s in enumerate(specs) if s.kind != "speculative"]
            dealt = deal(len(rest), self.CHUNKS_PER_PROCESS * self.pool.processes) if rest else []
            chunks = [[i] for i in long] + [[rest[j] for j in ids] for ids in dealt]
            parts = self.pool.map(run_part, [(bench, [specs[i] for i in ids]) for ids in chunks])
            return gather(len(specs), chunks, list(parts))
        shape = WorkerShape.of(self.rt)
        here = self.rt.task_runner == "local"  # the local runner's tasks are threads of this process
        with DriverThreads.of(self.rt) if here else contextlib.nullcontext(), Placement.of(self.rt):
            futures = [sweep_pass_task.submit(bench, specs, i, ids, shape) for i, ids in enumerate(chunks)]
            return gather(len(specs), chunks, [f.result() for f in futures])
