"""What one request may ask of `citer serve`, how many may wait, who may call it, and what /health shows.

The app is the real one on the tiny random pair: limits through FastAPI's TestClient, the queue and /health under
load through uvicorn on loopback with concurrent clients, the bind and key checks through `citer serve`'s own path.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import REPO
from fastapi.testclient import TestClient
from live import serving, spread_engine, wait_for

from citer.serving.server import ServeError, build_app, check_bind, is_loopback, public_ref

MODEL = "citer-test"
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return spread_engine(tiny_pair)


def _app(engine, tok, **kw):
    return build_app(engine, tok, model_name=MODEL, max_new_tokens=MAX_NEW, **kw)


def _completion(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, **kw}


# ---------------------------------------------------------------------------------------------------------------
# 400: too many prompts, too many tokens


def test_too_many_prompts_is_400_naming_the_limit(engine, tiny_pair):
    with TestClient(_app(engine, tiny_pair[2], max_prompts_per_request=4)) as tc:
        r = tc.post("/v1/completions", json=_completion(["Question: 1\nAnswer:"] * 5, max_tokens=2))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "prompt"
        assert err["code"] == "too_many_prompts"
        assert "5 prompts" in err["message"] and "at most 4" in err["message"]
        assert "serve.max_prompts_per_request" in err["message"]
        ok = tc.post("/v1/completions", json=_completion(["Question: 1\nAnswer:"] * 4, max_tokens=2))
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_twenty_thousand_prompts_are_refused_without_touching_the_engine(engine, tiny_pair):
    """The measured problem: one request of 20,000 prompts held the engine for 25 s. Now it never reaches it."""

    class Spy:  # the engine, but a decode fails the test
        def __getattr__(self, name):
            return getattr(engine, name)

        def session(self, **kw):
            raise AssertionError("the engine was asked to decode")

    app = _app(Spy(), tiny_pair[2])  # the defaults: 64 prompts per request
    with TestClient(app) as tc:
        r = tc.post("/v1/completions", json=_completion(["1 + 1 ="] * 20_000, max_tokens=1))
    assert r.status_code == 400
    assert "20000 prompts" in r.json()["error"]["message"] and "at most 64" in r.json()["error"]["message"]
    assert app.state.citer.queue_state()["waiting"] == 0


def test_too_many_tokens_is_400_naming_the_limit(engine, tiny_pair):
    with TestClient(_app(engine, tiny_pair[2], max_tokens_per_request=40)) as tc:
        two = ["Question: 1\nAnswer:", "Question: 2\nAnswer:"]
        r = tc.post("/v1/completions", json=_completion(two))  # max_tokens defaults to MAX_NEW: 2 x 24 = 48
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["code"] == "too_many_tokens"
        assert f"max_tokens={MAX_NEW} = 48 tokens" in err["message"] and "at most 40" in err["message"]
        assert "serve.max_tokens_per_request" in err["message"]
        assert (
            tc.post("/v1/completions", json=_completion(two, max_tokens=20)).status_code == 200
        )  # 40: at it
        # max_tokens above the server's max_new_tokens is refused on its own.
        r = tc.post("/v1/completions", json=_completion("Question: 1\nAnswer:", max_tokens=MAX_NEW + 1))
        assert r.status_code == 400 and f"<= {MAX_NEW}" in r.json()["error"]["message"]


def test_limits_that_contradict_each_other_are_refused(engine, tiny_pair):
    with pytest.raises(ServeError, match="max_tokens_per_request=10 is below serve.max_new_tokens=24"):
        _app(engine, tiny_pair[2], max_tokens_per_request=10)
    with pytest.raises(ServeError, match="max_queued_requests must be >= 1"):
        _app(engine, tiny_pair[2], max_queued_requests=0)


# ---------------------------------------------------------------------------------------------------------------
# 429: the queue is full; /health answers meanwhile


def test_full_queue_is_429_with_retry_after(engine, tiny_pair):
    """With the engine taken, exactly max_queued of 10 concurrent requests wait; the others get 429 at once."""
    app = _app(engine, tiny_pair[2], max_queued_requests=4)
    srv = app.state.citer
    body = _completion("Question: 3\nAnswer:", max_tokens=2)
    with serving(app) as base, ThreadPoolExecutor(10) as pool:
        assert srv.lock.acquire(timeout=5)
        try:
            futs = [
                pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60) for _ in range(10)
            ]
            wait_for(lambda: sum(f.done() for f in futs) >= 6, "the refused requests")
            refused = [f.result() for f in futs if f.done()]
            assert len(refused) == 6 and {r.status_code for r in refused} == {429}
            assert srv.queue_state() == {
                "busy": False,
                "waiting": 4,
                "active_rows": 0,
                "max_queued_requests": 4,
            }
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert "4 requests are already waiting" in err["message"]
            assert "serve.max_queued_requests=4" in err["message"]
        finally:
            srv.lock.release()
        waited = [f.result() for f in futs if f.result().status_code != 429]
    assert len(waited) == 4 and all(r.status_code == 200 and r.json()["choices"] for r in waited)
    assert srv.queue_state() == {"busy": False, "waiting": 0, "active_rows": 0, "max_queued_requests": 4}


def test_health_answers_while_the_engine_is_busy(engine, tiny_pair, tmp_path):
    """45 requests wait for the engine (more than the 40 worker threads a sync endpoint would hold): /health still
    answers at once, from state kept outside the engine lock, and names the models without absolute paths."""
    info = {"router": "test/7", "slm": str(tmp_path / "models" / "slm"), "llm": "Qwen/Qwen2.5-1.5B-Instruct"}
    app = _app(engine, tiny_pair[2], max_queued_requests=64, info=info)
    srv = app.state.citer
    n = 45
    body = _completion("Question: 4\nAnswer:", max_tokens=1)
    with serving(app) as base, ThreadPoolExecutor(n) as pool:
        assert srv.lock.acquire(timeout=5)
        try:
            futs = [
                pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=120) for _ in range(n)
            ]
            wait_for(lambda: srv.queue_state()["waiting"] == n, f"{n} waiting requests")
            t0 = time.perf_counter()
            h = httpx.get(f"{base}/health", timeout=5)
            took = time.perf_counter() - t0
        finally:
            srv.lock.release()
        done = [f.result() for f in futs]
    assert h.status_code == 200 and took < 2.0
    health = h.json()
    assert health["queue"] == {"busy": False, "waiting": n, "active_rows": 0, "max_queued_requests": 64}
    assert (
        health["router"] == "test/7"
        and health["slm"] == "slm"
        and health["llm"] == "Qwen/Qwen2.5-1.5B-Instruct"
    )
    assert str(tmp_path) not in h.text and not any(str(v).startswith("/") for v in health.values())
    assert health["limits"]["max_prompts_per_request"] == 64
    assert all(r.status_code == 200 for r in done)
    assert done[0].json()["citer"]["slm"] == "slm"  # the stats of every answer name it the same way


def test_public_ref_never_shows_an_absolute_path(tmp_path):
    root = tmp_path / "project"
    (root / "models" / "slm").mkdir(parents=True)
    assert public_ref(str(root / "models" / "slm"), root) == "models/slm"
    assert public_ref(str(tmp_path / "shared" / "llm"), root) == "llm"  # outside the project: its name only
    assert public_ref("/srv/models/slm") == "slm"
    assert public_ref("models/slm") == "models/slm" and public_ref("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert public_ref(0.5) == 0.5


# ---------------------------------------------------------------------------------------------------------------
# Who may call: loopback or a key; the key on every route but /health


def test_api_key_required_on_every_request_but_health(engine, tiny_pair):
    with TestClient(_app(engine, tiny_pair[2], api_key="sekret")) as tc:
        body = _completion("Question: 1\nAnswer:", max_tokens=2)
        for path in ("/v1/models", "/openapi.json"):
            r = tc.get(path)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.text
        r = tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
        ok = {"Authorization": "Bearer sekret"}
        assert tc.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert tc.get("/openapi.json", headers=ok).status_code == 200
        assert tc.get("/health").status_code == 200
        # A stream passes the key check once and then streams through it untouched.
        with tc.stream("POST", "/v1/completions", json=body | {"stream": True}, headers=ok) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3
        with tc.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 401


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "LOCALHOST", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.1.2.3", "example.org", "192.168.0.1"))
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "k")
    check_bind("0.0.0.0", None, allow_remote_without_key=True)
    with pytest.raises(ServeError, match="not a loopback address; set MY_KEY"):
        check_bind("0.0.0.0", None, api_key_env="MY_KEY")


@pytest.fixture
def bare_project(tmp_path, monkeypatch) -> Path:
    """A project with params.yaml only: no registry, no models, so only a check made before loading can pass it."""
    import shutil

    root = tmp_path / "bare"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(root)
    monkeypatch.delenv("CITER_API_KEY", raising=False)
    monkeypatch.delenv("CITER_ROOT", raising=False)
    return root


def test_citer_serve_refuses_a_remote_host_without_key_in_one_line(bare_project, monkeypatch):
    from typer.testing import CliRunner

    import citer.cli as cli
    import citer.cli.common as cli_common

    # the CLI's tool-quieting env changes stay out of this process
    monkeypatch.setattr(cli_common, "_setup", lambda: None)
    r = CliRunner().invoke(cli.app, ["serve", "--params", "params.yaml", "--host", "0.0.0.0"])
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: refusing to serve on '0.0.0.0' without an API key")
    assert "CITER_API_KEY" in lines[0] and "serve.allow_remote_without_key" in lines[0]


def test_serve_champion_passes_key_limits_and_public_names(
    bare_project, engine, tiny_pair, tmp_path, monkeypatch
):
    """`citer serve`'s path up to uvicorn: the key from serve.api_key_env opens a remote host and is required; the
    limits come from params; the models are named relative to the project, or by their name when outside it."""
    import citer.serving.server as server

    (bare_project / "models" / "slm").mkdir(parents=True)
    info = {
        "router": "citer-router/1",
        "slm": str(bare_project / "models" / "slm"),
        "llm": str(tmp_path / "llm"),
    }
    monkeypatch.setattr(
        server, "load_champion", lambda proj, llm_fraction=None, **_: (engine, tiny_pair[2], info)
    )
    seen: dict = {}
    monkeypatch.setattr(server, "serve", lambda engine, tok, **kw: seen.update(kw))
    monkeypatch.setenv("CITER_API_KEY", "k3y")
    server.serve_champion(bare_project, host="0.0.0.0", port=8123)
    assert seen["host"] == "0.0.0.0" and seen["api_key"] == "k3y" and seen["api_key_env"] == "CITER_API_KEY"
    assert seen["info"]["slm"] == "models/slm" and seen["info"]["llm"] == "llm"
    assert (seen["max_prompts_per_request"], seen["max_tokens_per_request"], seen["max_queued_requests"]) == (
        64,
        65536,
        32,
    )
    assert seen["allow_remote_without_key"] is False
