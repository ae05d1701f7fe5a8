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

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def run_jobs(fn: Callable[[J], R], jobs: Sequence[J], processes: int) -> Iterator[R]:
    """Yield ``fn(job)`` for each of ``jobs``, in their order; on ``processes`` worker processes when it is above 1
    (:func:`citer.ops.threads.job_processes` chooses it), else here, one after the other.

    ``fn`` must be importable (a module-level function), ``jobs`` and the results plain data. A job that fails raises
    its error where its result would have been yielded; with workers, the jobs still running are stopped then."""
    if processes <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(job)
        return
    pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"), initializer=_one_thread)
    try:
        # The workers start at the first submit and read this before torch starts its threads.
        with _environ(OMP_NUM_THREADS="1"):
            futures = [pool.submit(fn, job) for job in jobs]
        for f in futures:
            yield f.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((pool._processes or {}).values()):  # the pool does not stop a job that is running
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
