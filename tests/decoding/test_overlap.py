"""Overlapped steps (``RoutedEngine(overlap=True)``, citer.decoding.session): the SLM's call is queued while the LLM's
catch-up is in flight and the LLM's tokens reach the SLM a step later -- and no row's tokens change."""

from __future__ import annotations

import pytest
import torch
from conftest import decoding_pair, spread_router

from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import EngineInputError, RoutedEngine
from citer.decoding.session import DecodeSession, SideStream

V = 97
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40], [3, 4, 5], [60, 61]]
BUDGETS = [4, 9, 6, 12, 3, 8]  # rows end at different steps: slots free and refill mid-batch


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def run(
    eng: RoutedEngine, max_rows: int | None = None, temperature: float = 0.0, logprobs: int | None = None
):
    """Every row's emitted events, in order, and the session (its ``overlapped`` count)."""
    sess = eng.session(max_rows=max_rows, temperature=temperature, seed=3)
    keys = [
        sess.add(p, n, row_id=i, logprobs=logprobs)
        for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))
    ]
    got: dict[int, list[tuple]] = {k: [] for k in keys}
    steps = 0
    while sess.busy:
        steps += 1
        for em in sess.step():
            got[em.key].append((em.token, em.from_llm, em.done, em.logprob, em.top_logprobs, em.replaced))
    return [got[k] for k in keys], sess, steps


def _floats(e: tuple) -> list[float]:
    """An event's log-prob and its top (token, log-prob) pairs, flat; a missing one as nan (equal only to nan)."""
    lp, top = e[3], e[4]
    return [float("nan") if lp is None else lp] + [x for t, v in (top or []) for x in (t, v)]


CASES = {
    "greedy": dict(router=lambda: RandomRouter(0.3, seed=5)),
    "sampled": dict(router=lambda: RandomRouter(0.3, seed=5), temperature=0.8),
    "joining": dict(router=lambda: RandomRouter(0.4, seed=2), max_rows=3),
    "shared_calls": dict(router=lambda: RandomRouter(0.3, seed=5), llm_min_rows=2, llm_max_wait_steps=2),
    "fixed_shape": dict(router=lambda: spread_router(32), forward="fixed"),
    "verified": dict(router=lambda: spread_router(32), verify_rho=1.0, verify_window=3, verify_final=True),
    "verified_fixed": dict(
        router=lambda: spread_router(32), verify_rho=1.0, verify_window=2, forward="fixed"
    ),
    "logprobs": dict(router=lambda: RandomRouter(0.3, seed=5), logprobs=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_steps_emit_every_rows_tokens_of_sequential_steps(pair, case):
    kw = dict(CASES[case])
    router = kw.pop("router")
    run_kw = {k: kw.pop(k) for k in ("max_rows", "temperature", "logprobs") if k in kw}
    slm, llm = pair
    seq, seq_sess, seq_steps = run(
        RoutedEngine(slm, llm, router(), tau=0.5, eos_token_id=[7, 50], **kw), **run_kw
    )
    ovl, ovl_sess, ovl_steps = run(
        RoutedEngine(slm, llm, router(), tau=0.5, eos_token_id=[7, 50], overlap=True, **kw), **run_kw
    )
    # Tokens exactly; log-probs to float rounding (a row's LLM calls may batch with other rows than before).
    assert [[e[:3] + e[5:] for e in row] for row in ovl] == [[e[:3] + e[5:] for e in row] for row in seq]
    floats = [[x for row in got for e in row for x in _floats(e)] for got in (ovl, seq)]
    assert len(floats[0]) == len(floats[1]) and floats[0] == pytest.approx(floats[1], abs=1e-5, nan_ok=True)
    assert any(e[1] for row in seq for e in row)  # the LLM wrote tokens here
    assert seq_sess.meter.overlapped == 0 and ovl_sess.meter.overlapped > 0
    assert ovl_steps > seq_steps  # each overlapped LLM token reaches its row's SLM a step later


def test_an_overlapped_step_queues_the_slm_call_before_it_reads_the_llms_tokens(pair, monkeypatch):
    order: list[str] = []
    for name, attr in (("launch", "_llm_launch"), ("finish", "_llm_finish"), ("feed", "_feed_slm")):
        real = getattr(DecodeSession, attr)

        def spy(self, *a, _real=real, _name=name, **k):
            order.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(DecodeSession, attr, spy)
    slm, llm = pair
    eng = RoutedEngine(slm, llm, RandomRouter(0.5, seed=1), tau=0.5, overlap=True)
    sess = eng.session()
    for i in range(3):
        sess.add(PROMPTS[i], 8, row_id=i)
    while sess.busy:
        order.append("|")
        sess.step()
    steps = "".join(order).split("|")
    overlapped = [s for s in steps if s.startswith("launchfeed")]
    assert len(overlapped) == sess.meter.overlapped > 0
    assert all(s == "launchfeedfinish" for s in overlapped)
    # Elsewhere (no other row advancing: nothing to overlap) the call is sequential: launch, finish, then feed.
    assert all(s in ("", "feed", "launchfinishfeed", "launchfinish", "launchfeedfinish") for s in steps), (
        steps
    )


def test_a_lone_row_has_nothing_to_overlap_and_keeps_its_steps(pair):
    slm, llm = pair
    kw = dict(tau=0.5, eos_token_id=[7, 50])
    one = [PROMPTS[2]]
    seq = RoutedEngine(slm, llm, RandomRouter(0.4, seed=2), **kw).generate_batch(one, 12)
    ovl = RoutedEngine(slm, llm, RandomRouter(0.4, seed=2), overlap=True, **kw).generate_batch(one, 12)
    assert ovl.tokens == seq.tokens and ovl.from_llm == seq.from_llm and any(seq.from_llm[0])
    assert ovl.batch.decode_steps == seq.batch.decode_steps and ovl.batch.overlapped_steps == 0


def test_overlap_must_be_a_bool(pair):
    slm, llm = pair
    with pytest.raises(EngineInputError, match="overlap"):
        RoutedEngine(slm, llm, RandomRouter(0.3), overlap="yes")  # type: ignore[arg-type]


def test_the_catch_up_runs_on_the_current_stream_off_cuda(pair):
    slm, llm = pair
    for overlap in (False, True):
        side = SideStream.for_engine(RoutedEngine(slm, llm, RandomRouter(0.3), overlap=overlap))
        assert side.stream is None
        with side.run():  # a no-op context: program order
            assert torch.ones(1).item() == 1.0
        side.join()
