"""citer.ops.processes: worker processes that end as they should."""

from __future__ import annotations

from citer.ops.processes import JobPool, run_jobs


def test_a_round_closed_after_its_last_result_lets_the_workers_exit_normally():
    """A consumer that stops after the last result (``zip`` over the jobs, ``close()``) is not a failure: the idle
    workers get the pool's own shutdown, not SIGTERM (a terminated worker left its queue's semaphores behind)."""
    with JobPool(2) as pool:
        results = pool.map(abs, [-1, -2, -3])
        assert [next(results) for _ in range(3)] == [1, 2, 3]
        workers = list(pool._pool._processes.values())  # type: ignore[union-attr]
        results.close()
    assert workers and [w.exitcode for w in workers] == [0] * len(workers)


def test_run_jobs_in_order_on_workers_and_here():
    assert list(run_jobs(abs, [-3, 1, -2], 2)) == list(run_jobs(abs, [-3, 1, -2], 0)) == [3, 1, 2]
