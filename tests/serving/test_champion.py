"""The registry's champion as a ready decoder: its SLM, LLM, router and tau, with overrides and refusals."""

from __future__ import annotations

import pytest
from conftest import spread_router


@pytest.mark.slow  # three registered versions and three model loads: ~25 s on 2 busy cores
def test_engine_from_champion(tiny_pair_dirs, tmp_path, monkeypatch):
    """The registry's champion -> its SLM, LLM, router and tau in an engine that decodes; serve.tau overrides tau."""
    import mlflow

    from citer.config import Params
    from citer.project import Project
    from citer.routing.iterations import pair_digests
    from citer.routing.mlp import save_router
    from citer.serving.champion import load_champion
    from citer.tracking.alias import set_alias
    from citer.tracking.deployed import ChampionError
    from citer.tracking.registry import register_router

    slm_dir, llm_dir = tiny_pair_dirs
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("serve", artifact_location=(tmp_path / "art").as_uri())
    # params name the champion's pair (outside the project: recorded and compared as absolute paths)
    models = {"finetuned_slm": str(slm_dir), "llm": str(llm_dir)}
    params = Params.model_validate({"registry": {"model_name": "router-serve"}, "models": models})
    proj = Project(root=tmp_path, params=params)

    def register(hidden: int, tau: float, **extra: str) -> str:
        meta = {"slm": str(slm_dir), "llm": str(llm_dir)} | pair_digests(slm_dir, llm_dir)
        rdir = save_router(spread_router(hidden), tmp_path / f"router{hidden}", meta)
        run = client.create_run(exp)
        tags = {"slm": str(slm_dir), "llm": str(llm_dir), "tau": tau, **extra}
        rv = register_router(
            rdir, model_name="router-serve", run_id=run.info.run_id, tags=tags, tracking_uri=uri
        )
        set_alias("router-serve", "champion", rv.version, tracking_uri=uri)
        return rv.version

    version = register(32, 0.3)
    engine, tok, info = load_champion(proj)
    assert engine.tau == 0.3 and info["router"] == f"router-serve/{version}" and info["slm"] == str(slm_dir)
    res = engine.generate_batch(
        [tok.encode("Question: 1\nAnswer:", add_special_tokens=False)], max_new_tokens=5
    )
    assert len(res.tokens[0]) >= 1

    params.serve.tau = 0.9
    assert load_champion(proj).engine.tau == 0.9
    assert load_champion(proj, tau=0.2).engine.tau == 0.2
    assert not engine.verify.on  # a version registered without verification routes as plain CITER

    # a verified point: the engine checks with the version's rho, window and final check
    register(32, 0.4, verify_rho="1.5", verify_window="4", verify_final="true")
    engine, _, info = load_champion(proj)
    assert (engine.verify.rho, engine.verify.window, engine.verify.final) == (1.5, 4, True)
    assert info["verify_rho"] == 1.5

    # engine.forward reaches the engine: both models' lean forwards run compiled (nothing compiles until used), or
    # their steps run fixed-shape and captured
    assert set(engine.forward_paths.values()) == {"lean"}
    params.engine.forward = "compiled"
    assert set(load_champion(proj).engine.forward_paths.values()) == {"lean+compiled"}
    params.engine.forward = "graphs"
    got = load_champion(proj).engine
    assert got.forward == "graphs" and got.slm_runner.static is not None and got.llm_runner.static is not None
    params.engine.forward = "eager"
    # engine.overlap too
    assert not engine.overlap
    params.engine.overlap = True
    assert load_champion(proj).engine.overlap
    params.engine.overlap = False

    # a version whose τ was chosen on llama.cpp's 8-bit files decodes only there
    register(32, 0.4, runner="llama_cpp:Q8_0")
    with pytest.raises(
        ChampionError, match="chosen on runner llama_cpp:Q8_0, params.yaml's engine decodes with torch"
    ):
        load_champion(proj)
    from citer.config.serving import EngineParams
    from citer.decoding.llama_cpp_runner import missing

    if missing() is None:
        monkeypatch.setenv("CITER_GGUF_CACHE", str(tmp_path / "gguf"))
        params.engine = EngineParams(runner="llama_cpp", llama_cpp_type="Q8_0")
        engine, tok, _ = load_champion(proj)
        assert engine.runner == "llama_cpp" and engine.tau == 0.9  # serve.tau still overrides (above)
        assert engine.generate(tok.encode("Question: 1\nAnswer:", add_special_tokens=False), 5).tokens[0]
        params.engine = EngineParams()

    register(16, 0.5)  # a champion whose router was trained for another SLM
    with pytest.raises(ChampionError, match="hidden_size=16"):
        load_champion(proj)


@pytest.mark.slow  # a `citer serve` process: imports, model loads and uvicorn start, ~15 s
def test_citer_serve_serves_the_projects_champion(champion_project, tmp_path):
    """`citer serve` in a project: the champion's router and tau behind /health and /v1/completions on loopback."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), HF_HUB_OFFLINE="1")
    citer = Path(sys.executable).parent / "citer"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(citer), "serve", "--port", str(port)], cwd=champion_project, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "citer serve did not start"
                time.sleep(0.5)
        assert health["status"] == "ok" and health["router"] == "citer-router/1" and health["tau"] == 0.5
        body = {"model": "citer", "prompt": "Question: 1+2\nAnswer:", "max_tokens": 8}
        done = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert done["choices"][0]["text"] is not None and done["citer"]["version"] == "1"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
