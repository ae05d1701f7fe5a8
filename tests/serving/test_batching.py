"""Continuous batching in `citer serve`: requests share decoding steps, streams send tokens as they are decoded, a
client that leaves frees its rows, and every answer is the one the request gets alone. Real uvicorn, tiny models."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from live import serving, spread_engine, wait_for

from citer.decoding.engine import RoutedEngine
from citer.serving.server import build_app

MODEL = "citer-test"
MAX_NEW = 24
PROMPTS = [f"Question: {a} + {b}\nAnswer:" for a, b in ((1, 2), (13, 4), (7, 70), (5, 55), (2, 9), (31, 3))]


class SlowRouter(torch.nn.Module):
    """The spread router, slowed down per step so a test can act while a decode is still running."""

    def __init__(self, inner: torch.nn.Module, delay_s: float) -> None:
        super().__init__()
        self.inner, self.delay_s = inner, delay_s

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.inner(hidden)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return spread_engine(tiny_pair)


def _app(engine, tok, **kw):
    return build_app(engine, tok, model_name=MODEL, max_new_tokens=MAX_NEW, **kw)


def _body(prompt: str, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW, **kw}


def _stalled_then_released(app, bodies: list[dict]) -> list[dict]:
    """Hold the engine, queue every request, release it: the requests are admitted in one step and decode together."""
    srv = app.state.citer
    with serving(app) as base, ThreadPoolExecutor(len(bodies)) as pool:
        assert srv.lock.acquire(timeout=5)
        try:
            futs = [pool.submit(httpx.post, f"{base}/v1/completions", json=b, timeout=60) for b in bodies]
            wait_for(lambda: srv.queue_state()["waiting"] == len(bodies), "the queued requests")
        finally:
            srv.lock.release()
        out = [f.result() for f in futs]
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    return [r.json() for r in out]


@pytest.mark.parametrize("continuous", [True, False])
def test_concurrent_requests_get_the_answers_they_get_alone(engine, tiny_pair, continuous):
    _, _, tok = tiny_pair
    bodies = [_body(p, temperature=0.8 if i % 3 == 0 else 0.0, seed=i) for i, p in enumerate(PROMPTS)]
    alone = []
    app = _app(engine, tok)
    with serving(app) as base:
        for b in bodies:
            alone.append(httpx.post(f"{base}/v1/completions", json=b, timeout=60).json())
    together = _stalled_then_released(_app(engine, tok, continuous_batching=continuous), bodies)
    for a, t in zip(alone, together, strict=True):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
        assert t["usage"] == a["usage"]
        assert t["citer"]["tokens_by_model"] == a["citer"]["tokens_by_model"]
    moved = [
        t["citer"]["bytes_moved"] / a["citer"]["bytes_moved"] for a, t in zip(alone, together, strict=True)
    ]
    if continuous:  # the rows shared forward calls: each weight read was split among them
        assert max(moved) < 0.9
    else:  # one request at a time: nothing shared
        assert moved == pytest.approx([1.0] * len(moved))


def test_an_overlapping_engine_serves_the_answers_of_sequential_steps(engine, tiny_pair):
    """``engine.overlap``: concurrent requests through a server whose engine overlaps its two models get the texts
    and token counts the sequential engine gives them, and the overlap really happened."""
    slm, llm, tok = tiny_pair
    ovl = RoutedEngine(slm, llm, engine.router, tau=engine.tau, eos_token_id=tok.eos_token_id, overlap=True)
    bodies = [_body(p, temperature=0.8 if i % 3 == 0 else 0.0, seed=i) for i, p in enumerate(PROMPTS)]
    seq = _stalled_then_released(_app(engine, tok), bodies)
    app = _app(ovl, tok)
    got = _stalled_then_released(app, bodies)
    for a, t in zip(seq, got, strict=True):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
        assert t["citer"]["tokens_by_model"] == a["citer"]["tokens_by_model"]
    assert app.state.citer._sess.meter.overlapped > 0  # steps ran the SLM while their catch-up was in flight


def test_a_request_joins_a_running_batch(engine, tiny_pair):
    """A short request sent while a long one decodes finishes first: it did not wait for the long one."""
    _, _, tok = tiny_pair
    slow = RoutedEngine(
        engine.slm, engine.llm, SlowRouter(engine.router, 0.02), tau=0.5
    )  # no EOS: full budgets
    app = _app(slow, tok)
    done: dict[str, float] = {}
    with serving(app) as base, ThreadPoolExecutor(2) as pool:

        def post(name: str, max_tokens: int) -> dict:
            r = httpx.post(
                f"{base}/v1/completions", json=_body(PROMPTS[0], max_tokens=max_tokens), timeout=60
            )
            done[name] = time.monotonic()
            return r.json()

        long = pool.submit(post, "long", MAX_NEW)
        wait_for(lambda: app.state.citer.queue_state()["active_rows"] == 1, "the long request decoding")
        short = pool.submit(post, "short", 2)
        assert short.result()["usage"]["completion_tokens"] == 2
        assert long.result()["usage"]["completion_tokens"] == MAX_NEW
    assert done["short"] < done["long"]


def test_stream_sends_tokens_while_decoding_and_a_client_that_leaves_frees_its_row(engine, tiny_pair):
    _, _, tok = tiny_pair
    slow = RoutedEngine(
        engine.slm, engine.llm, SlowRouter(engine.router, 0.05), tau=0.5
    )  # >= 1.2 s per answer
    app = _app(slow, tok)
    srv = app.state.citer
    with serving(app) as base:
        full = httpx.post(f"{base}/v1/completions", json=_body(PROMPTS[1]), timeout=60).json()
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=_body(PROMPTS[1], stream=True), timeout=60
        ) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            # The first piece is here while the engine is still decoding the same answer.
            assert srv.queue_state()["active_rows"] == 1
            got = json.loads(first[6:])["choices"][0]["text"]
            assert full["choices"][0]["text"].startswith(got) and got
        # The client closed the stream after one chunk: its row is cancelled long before its 24 tokens.
        wait_for(lambda: srv.queue_state()["active_rows"] == 0, "the cancelled row to leave", timeout=5)
        left = srv._sess.meter.row_stats()[-1]
        assert left.new_tokens < MAX_NEW
        # The server keeps serving.
        again = httpx.post(f"{base}/v1/completions", json=_body(PROMPTS[1]), timeout=60).json()
        assert again["choices"][0]["text"] == full["choices"][0]["text"]


def test_many_clients_lose_no_request(engine, tiny_pair):
    _, _, tok = tiny_pair
    app = _app(engine, tok, max_batch_rows=4)
    bodies = [_body(PROMPTS[i % len(PROMPTS)], max_tokens=4 + i % 7) for i in range(24)]
    with serving(app) as base:
        ref = {
            i: httpx.post(f"{base}/v1/completions", json=b, timeout=60).json() for i, b in enumerate(bodies)
        }
        results: dict[int, dict] = {}
        lock = threading.Lock()

        def client(ids: list[int]) -> None:
            with httpx.Client(timeout=60) as c:
                for i in ids:
                    r = c.post(f"{base}/v1/completions", json=bodies[i])
                    with lock:
                        results[i] = r.json()

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client, [list(range(k, 24, 8)) for k in range(8)]))
    assert sorted(results) == list(range(24))
    assert all(results[i]["choices"][0]["text"] == ref[i]["choices"][0]["text"] for i in range(24))
