"""The registered model generates: `models:/<name>@champion` loaded by MLflow turns prompts into text and stats."""

from __future__ import annotations

import os

import pytest

from citer.tracking.registry import OUTPUT_COLUMNS

PROMPTS = ["Question: 1+2\nAnswer:", "Question: 7\nAnswer:"]


def _champion_uri() -> str:
    return "models:/citer-router@champion"


def test_champion_generates_from_another_cwd(champion_project, tmp_path, monkeypatch):
    """load_model + predict on two prompts -> one row of text and routing stats each, from any directory."""
    import mlflow
    import pandas as pd
    from mlflow.types import DataType

    from citer.project import load_project
    from citer.serving.champion import load_champion

    uri = load_project().tracking_uri
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative model refs must not depend on the current directory
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("CITER_ROOT", str(champion_project))
    model = mlflow.pyfunc.load_model(_champion_uri())

    sig = model.metadata.signature
    assert sig.inputs.input_types() == [DataType.string] and sig.outputs.input_names() == list(OUTPUT_COLUMNS)
    cfg = model.model_config
    assert cfg["slm"] == "models/slm" and cfg["llm"] == "models/llm" and cfg["tau"] == 0.5  # by reference

    out = model.predict(pd.DataFrame({"prompt": PROMPTS}), params={"max_new_tokens": 6})
    assert list(out.columns) == list(OUTPUT_COLUMNS) and len(out) == 2
    assert all(isinstance(t, str) for t in out["text"]) and (out["n_tokens"] >= 1).all()
    assert ((out["llm_token_fraction"] >= 0) & (out["llm_token_fraction"] <= 1)).all()

    # The same decoder as citer's own champion: same text, token for token (greedy, same tau).
    monkeypatch.chdir(champion_project)
    engine, tok, _ = load_champion(champion_project)
    res = engine.generate_batch([tok.encode(p, add_special_tokens=False) for p in PROMPTS], max_new_tokens=6)
    assert list(out["text"]) == [tok.decode(t, skip_special_tokens=True) for t in res.tokens]

    # A plain list works too; tau=1 sends every token to the LLM, tau=0 none.
    all_llm = model.predict(PROMPTS, params={"max_new_tokens": 4, "tau": 1.0})
    assert (all_llm["llm_token_fraction"] == 1.0).all() and (
        all_llm["llm_tokens"] == all_llm["n_tokens"]
    ).all()
    assert (model.predict(PROMPTS[:1], params={"max_new_tokens": 4, "tau": 0.0})["llm_tokens"] == 0).all()
    with pytest.raises(Exception, match="input row 2: field prompt must be a non-empty string"):
        model.predict(["ok", " "])


def test_project_root_in_the_loader_config_wins(champion_project, tmp_path, monkeypatch):
    """Without CITER_ROOT, a loader names the project root in model_config; a wrong root fails naming the model."""
    import mlflow

    from citer.project import load_project

    monkeypatch.setenv("MLFLOW_TRACKING_URI", load_project().tracking_uri)
    monkeypatch.chdir(tmp_path)
    model = mlflow.pyfunc.load_model(_champion_uri(), model_config={"project_root": str(champion_project)})
    assert len(model.predict(["Question: 3\nAnswer:"], params={"max_new_tokens": 3})) == 1
    with pytest.raises(Exception, match="models/slm"):  # resolved against the cwd: no such model here
        mlflow.pyfunc.load_model(_champion_uri())


@pytest.mark.slow  # an `mlflow models serve` process: imports, model load and uvicorn start, ~20 s
def test_mlflow_models_serve_answers_a_text_request(champion_project, tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    from citer.project import load_project

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        MLFLOW_TRACKING_URI=load_project().tracking_uri,
        CITER_ROOT=str(champion_project),
        HF_HUB_OFFLINE="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # mlflow runs `uvicorn`
    )
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow_bin), "models", "serve", "-m", _champion_uri(), "--env-manager", "local"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "-p", str(port), "-h", "127.0.0.1"], cwd=tmp_path, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlflow models serve did not start"
            time.sleep(0.5)
        body = {
            "dataframe_split": {"columns": ["prompt"], "data": [[PROMPTS[0]], [PROMPTS[1]]]},
            "params": {"max_new_tokens": 5},
        }
        resp = httpx.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        rows = resp.json()["predictions"]
        assert len(rows) == 2 and all(isinstance(r["text"], str) and r["n_tokens"] >= 1 for r in rows)
        bad = httpx.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": [""]}, timeout=60)
        assert bad.status_code >= 400 and "field prompt" in bad.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
