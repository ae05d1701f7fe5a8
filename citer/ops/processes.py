"""Independent jobs of one stage on the idle cores: a few worker processes, one torch thread each.

A stage of the embedded pair runs on one torch thread (:mod:`citer.ops.threads`): its models are small, so a second
thread gains little and spins against other work. Jobs that share nothing but their inputs on disk (the routers of
one label set, the two models of the bootstrap) can instead run side by side in separate processes, each on one
thread, which keeps every job's arithmetic -- and so its result -- exactly what it is in one process. Processes, not
threads: these loops are many small torch calls, so threads of one process would queue on the GIL.

Workers are spawned (a fork of a process running Prefect's and MLflow's threads is unsafe) and get only plain data
(job descriptions, paths); they read their inputs from disk and write their outputs atomically, so a killed worker
leaves nothing half-written. An interrupted command stops its workers with its other children
(:func:`citer.ops.interrupt.finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def _one_thread() -> None:
    """Each worker's first act, before any job can start torch's thread pool."""
    import torch

    torch.set_num_threads(1)


class JobPool:
    """Spawned worker processes of one torch thread, kept for several rounds of jobs (a context manager).

    ``fn`` must be importable (a module-level function); jobs and results travel between processes, so they are plain
    data or objects the standard library can copy (a stage's models are small when it runs one thread). A job that
    fails raises its error where its result would have been yielded; the jobs still running are stopped first."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> JobPool:
        self._pool = ProcessPoolExecutor(
            self.processes, mp_context=get_context("spawn"), initializer=_one_thread
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[R]:
        """Yield ``fn(job)`` for each of ``jobs``, in their order, as the workers finish them."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("JobPool.map outside its with block")
        futures = []
        try:
            futures = [pool.submit(fn, job) for job in jobs]
            for f in futures:
                yield f.result()
        except BaseException as exc:
            if isinstance(exc, GeneratorExit) and all(f.done() for f in futures):
                raise  # closed after its last result: the pool shuts down as after any round
            running = list((pool._processes or {}).values())  # shutdown forgets them and stops no running job
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in running:
                proc.terminate()
            for proc in running:
                proc.join(5)
            raise


def run_jobs(fn: Callable[[J], R], jobs: Sequence[J], processes: int) -> Iterator[R]:
    """Yield ``fn(job)`` for each of ``jobs``, in their order; on a :class:`JobPool` of ``processes`` workers when it
    is above 1 (:func:`citer.ops.threads.job_processes` chooses it), else here, one after the other."""
    if processes <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(job)
        return
    with JobPool(processes) as pool:
        yield from pool.map(fn, jobs)
