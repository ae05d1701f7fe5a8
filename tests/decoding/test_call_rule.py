"""The LLM queue's call rule derived from measured times, and the LLM's prompt read at admission: tokens never change."""

from __future__ import annotations

import pytest
from conftest import decoding_pair, spread_router

from citer.decoding.baselines import AlwaysLLM, RandomRouter
from citer.decoding.call_rule import FixedRule, MeasuredRule, StepTimes
from citer.decoding.engine import EngineInputError, RoutedEngine

V = 97


@pytest.fixture(scope="module")
def pair():
    return decoding_pair(V)


def _times(a: float, c: float, t_slm: float, arrivals: float, sizes=(4, 12, 40)) -> StepTimes:
    t = StepTimes()
    for n in sizes:
        t.llm_call(n, a + c * n)
    for i in range(8):  # arrivals as whole rows per step, averaging to ``arrivals``
        t.slm_step(t_slm, round(arrivals * (i + 1)) - round(arrivals * i))
    return t


def test_the_fit_recovers_the_call_line_and_waits_for_enough_calls():
    assert StepTimes().llm_fit() is None
    t = _times(0.2, 0.01, 0.05, 1.0)
    a, c = t.llm_fit()
    assert a == pytest.approx(0.2) and c == pytest.approx(0.01)
    one_size = StepTimes()
    for _ in range(5):
        one_size.llm_call(8, 0.3)
    assert one_size.llm_fit() is None  # no slope from calls of one size
    assert t.slm_seconds() == pytest.approx(0.05) and t.arrivals() == pytest.approx(1.0)


def test_measured_rule_waits_only_while_waiting_pays():
    rule = MeasuredRule()
    assert rule.due([0], StepTimes())  # nothing measured yet: at once
    cheap_slm = _times(0.2, 0.01, 0.05, 1.0)  # a step of waiting (0.05 s) < the call it may merge (1 x 0.2 s)
    assert not rule.due([0], cheap_slm)
    # ... until the oldest waited as long as a call's fixed part (0.2 s): 3 steps of 0.05 s no, 5 yes
    assert not rule.due([3, 0], cheap_slm) and rule.due([5, 0], cheap_slm)
    costly_slm = _times(0.2, 0.01, 0.5, 1.0)  # a step costs more than the merged call saves
    assert rule.due([0], costly_slm)
    rare = _times(0.2, 0.01, 0.05, 0.125)  # one routed row every 8 steps: 0.125 x 0.2 <= 0.05
    assert rule.due([0], rare)


def test_fixed_rule_counts_rows_and_steps():
    assert FixedRule().due([0], StepTimes())
    r = FixedRule(3, 2)
    assert not r.due([0, 1], StepTimes()) and r.due([0, 1, 0], StepTimes()) and r.due([2], StepTimes())


class FrozenTimes(StepTimes):
    """Step times fixed by the test (the rule's input), whatever the tiny models' calls take."""

    def __init__(self, frozen: StepTimes) -> None:
        super().__init__(frozen.llm, frozen.slm, frozen.routed)

    def llm_call(self, tokens: int, seconds: float) -> None:
        pass

    def slm_step(self, seconds: float, routed: int) -> None:
        pass


@pytest.mark.parametrize("t_slm", [0.01, 0.05])
def test_a_measured_schedule_changes_no_token_shares_calls_and_bounds_each_wait(pair, t_slm):
    slm, llm = pair
    prompts = [[(7 * i + j) % V for j in range(3 + i % 5)] for i in range(16)]
    at_once = RoutedEngine(slm, llm, RandomRouter(0.15, seed=2), tau=0.5)
    measured = RoutedEngine(slm, llm, RandomRouter(0.15, seed=2), tau=0.5, llm_schedule="measured")
    measured.times = FrozenTimes(_times(0.2, 0.01, t_slm, 2.0))
    a, b = at_once.generate_batch(prompts, 20), measured.generate_batch(prompts, 20)
    assert b.tokens == a.tokens and b.from_llm == a.from_llm
    assert b.batch.llm_calls < a.batch.llm_calls and b.batch.wait_row_steps > 0
    # No routed token waits longer than a call's fixed part: 0.2 s / t_slm steps.
    assert max(r.wait_steps for r in b.rows) <= round(0.2 / t_slm) * max(r.llm_tokens for r in b.rows)


def test_a_measured_schedule_learns_from_the_engines_own_calls(pair):
    slm, llm = pair
    prompts = [[(5 * i + j) % V for j in range(2 + i % 7)] for i in range(12)]
    eng = RoutedEngine(slm, llm, RandomRouter(0.2, seed=4), tau=0.5, llm_schedule="measured")
    ref = RoutedEngine(slm, llm, RandomRouter(0.2, seed=4), tau=0.5).generate_batch(prompts, 16)
    for _ in range(2):  # the second batch starts from the first one's times
        assert eng.generate_batch(prompts, 16).tokens == ref.tokens
    assert eng.times.llm_fit() is not None and eng.times.slm_seconds() is not None


@pytest.mark.parametrize("verify", [{}, {"verify_rho": 0.3, "verify_window": 2, "verify_final": True}])
@pytest.mark.parametrize("router", ["random", "mlp", "always_llm"])
def test_reading_prompts_at_admission_changes_no_token(pair, router, verify):
    slm, llm = pair
    prompts = [[(11 * i + j) % V for j in range(1 + i % 6)] for i in range(9)]

    def make(**kw):
        r = {"random": lambda: RandomRouter(0.3, seed=1), "mlp": lambda: spread_router(slm.config.hidden_size),
             "always_llm": AlwaysLLM}[router]()  # fmt: skip
        return RoutedEngine(slm, llm, r, tau=0.5, **verify, **kw)

    lazy = make().generate_batch(prompts, 12, max_rows=4)
    admit = make(llm_prefill="admit").generate_batch(prompts, 12, max_rows=4)
    assert admit.tokens == lazy.tokens and admit.from_llm == lazy.from_llm and admit.replaced == lazy.replaced
    # The same prompt tokens reach the LLM, every one of them (some rows' in calls of their own at admission).
    assert admit.batch.llm_prompt_tokens == sum(len(p) for p in prompts)
    assert admit.batch.llm_catchup_tokens == lazy.batch.llm_catchup_tokens


@pytest.mark.parametrize("bad", [dict(llm_schedule="auto"), dict(llm_prefill="eager")])
def test_bad_schedule_params_are_refused(pair, bad):
    with pytest.raises(EngineInputError, match=next(iter(bad))):
        RoutedEngine(*pair, RandomRouter(0.1), **bad)


def test_the_rule_an_engine_block_names_is_checked():
    from citer.decoding.call_rule import FixedRule, MeasuredRule, call_rule

    assert call_rule("fixed", 4, 3) == FixedRule(4, 3) and call_rule("measured", 4, 3) == MeasuredRule()
    for bad, field in ((("fixed", 0, 0), "llm_min_rows"), (("fixed", 1, -1), "llm_max_wait_steps"),
                       (("fixed", True, 0), "llm_min_rows"), (("often", 1, 0), "llm_schedule")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            call_rule(*bad)
