"""The sweep's passes as specs mapped over a task runner: the rows do not depend on where the passes ran."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from conftest import answering_rows

from citer.config import RuntimeParams, SweepParams
from citer.evaluation.plan import PassBench, PassSpec, deal, gather, run_in_order
from citer.evaluation.sweep_rows import SweepError


def test_deal_and_gather_restore_spec_order():
    assert deal(5, 2) == [[0, 2, 4], [1, 3]]
    assert deal(2, 8) == [[0], [1]] and deal(0, 3) == [] and deal(3, 0) == [[0, 1, 2]]
    chunks = deal(7, 3)
    parts = [[f"out{i}" for i in ids] for ids in chunks]
    assert gather(7, chunks, parts) == [f"out{i}" for i in range(7)]
    with pytest.raises(SweepError, match="returned no outcome"):
        gather(3, [[0, 1]], [["a", "b"]])


def test_a_spec_carries_engine_arguments(tiny_pair):
    slm, llm, tok = tiny_pair
    bench = PassBench(slm, llm, tok, "math", SweepParams(), routers={"r": lambda h: h[:, 0]})
    spec = PassSpec("dev r", "dev", method="r", router="r", tau=0.3, engine={"llm_max_wait_steps": 2})
    assert bench.engine(spec).tau == 0.3
    with pytest.raises(TypeError, match="no_such_knob"):  # passed through to RoutedEngine as they are
        bench.engine(dataclasses.replace(spec, engine={"no_such_knob": 1}))
    with pytest.raises(SweepError, match="router 'x' unknown"):
        bench.engine(dataclasses.replace(spec, router="x"))


def _sweep(pair, passes=run_in_order):
    import torch

    from citer.evaluation.sweep import run_sweep
    from citer.routing.mlp import MLPRouter

    slm, llm, tok = pair
    torch.manual_seed(0)
    router = MLPRouter(slm.config.hidden_size).eval()
    torch.manual_seed(1)
    other = MLPRouter(slm.config.hidden_size).eval()
    params = SweepParams(
        llm_fractions=[0.1, 0.3, 0.5],
        batch_size=5,
        max_new_tokens=8,
        query={"train_examples": 16, "epochs": 20},
    )
    return run_sweep(
        slm,
        llm,
        tok,
        answering_rows(11, 12),
        answering_rows(12, 12),
        "math",
        {"citer": router, "citer_s": other},
        params,
        train_rows=answering_rows(13, 16),
        champion=other,
        passes=passes,
    )


def _rows(res):
    """Everything but wall-clock timings."""

    def strip(r):
        d = dataclasses.asdict(r)
        d["extra"].pop("pass_seconds", None)
        d.pop("sec_per_token")
        return d

    chosen = {m: strip(r) if r else None for m, r in res.chosen.items()}
    return [strip(r) for r in res.dev], [strip(r) for r in res.test], res.thresholds, res.quantiles, chosen


@pytest.mark.parametrize("runner", ["local", "dask"])
def test_two_workers_give_the_rows_of_one(tiny_pair, prefect_server, runner):
    """Every pass of the sweep (oracle, speculative, the champion, the query router included) as tasks on two
    workers (threads, or two Dask worker processes with one torch thread each): byte-identical rows."""
    from prefect import flow

    from flows.runners import SweepPasses, TaskRunners

    rt = RuntimeParams(task_runner=runner, workers=2)

    @flow(name="test-sweep-passes")
    def sweep_on_runner():
        return _sweep(tiny_pair, SweepPasses(rt))

    one = _sweep(tiny_pair)
    two = sweep_on_runner.with_options(task_runner=TaskRunners.build(rt))()
    assert len(one.test) > 10 and {r.method for r in one.test} >= {
        "oracle",
        "speculative",
        "champion",
        "query",
    }
    assert _rows(two) == _rows(one)


def test_two_worker_processes_give_the_rows_of_one(tiny_pair):
    """The local runner's passes on two spawned processes of one torch thread (the bench sent to each in chunks):
    byte-identical rows; one process is chosen only for a one-thread stage."""
    import torch

    from citer.ops.processes import JobPool
    from citer.ops.threads import usable_cores
    from flows.runners import SweepPasses

    rt = RuntimeParams(workers=2)
    with JobPool(2) as pool:
        two = _sweep(tiny_pair, SweepPasses(rt, pool))
    assert _rows(two) == _rows(_sweep(tiny_pair))
    before = torch.get_num_threads()
    try:
        for threads, pooled in ((1, True), (2, False)):
            torch.set_num_threads(threads)
            with SweepPasses.local_processes(rt) as passes:
                assert (passes.pool is not None) == (pooled and usable_cores() > 1)
        with SweepPasses.local_processes(rt.model_copy(update={"workers": 1})) as passes:
            assert passes.pool is None
        # A pair off the CPU (here the meta device stands in for CUDA) is never pickled into worker processes.
        torch.set_num_threads(1)
        slm, llm = tiny_pair[0], tiny_pair[1]
        with SweepPasses.local_processes(rt, slm, llm) as passes:
            assert (passes.pool is not None) == (usable_cores() > 1)
        with SweepPasses.local_processes(rt, slm, copy.deepcopy(llm).to("meta")) as passes:
            assert passes.pool is None
    finally:
        torch.set_num_threads(before)


def test_one_worker_runs_here_with_its_torch_threads_then_restores_them(tiny_pair, monkeypatch):
    import torch

    from citer.evaluation import plan
    from citer.evaluation.sweep import _split
    from flows.runners import SweepPasses

    slm, llm, tok = tiny_pair
    bench = PassBench(slm, llm, tok, "math", SweepParams(batch_size=2, max_new_tokens=3))
    bench.splits["dev"] = _split(tok, answering_rows(1, 3), "math", 0, "dev")
    specs = [
        PassSpec("dev llm", "dev", "llm", "llm"),
        PassSpec("dev p", "dev", method="random", router="random"),
    ]
    specs[1] = dataclasses.replace(specs[1], fraction=0.5)
    seen = []
    monkeypatch.setattr(plan, "decode_pass", lambda *a, **k: seen.append(torch.get_num_threads()) or "res")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = SweepPasses(RuntimeParams(threads_per_worker=1))(bench, specs)
        assert [o.result for o in outs] == ["res", "res"] and seen == [1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
