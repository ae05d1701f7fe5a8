"""infra/prefect.yaml deploys for real: `prefect deploy --all` against a Prefect server, then read back.

The server is the session's temporary one (tests/conftest.py ``prefect_server``); the CLI runs as a subprocess
pointed at it through PREFECT_API_URL, as a user's shell would be.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO

PREFECT_FILE = REPO / "infra" / "prefect.yaml"
FLOW_FILES = ("flows/pipeline.py", "flows/batch_inference.py")

# Stand-ins with the lead's flow signatures, written only into the test's tmp dir while the real flows are missing.
_PLACEHOLDERS = {
    "flows/pipeline.py": """
        from prefect import flow

        @flow(name="pipeline")
        def pipeline_flow(params_path: str = "params.yaml") -> None:
            pass
    """,
    "flows/batch_inference.py": """
        from prefect import flow

        @flow(name="batch-inference")
        def batch_inference_flow(
            params_path: str = "params.yaml", input: str | None = None, output: str | None = None
        ) -> None:
            pass
    """,
}


def _workdir(tmp_path: Path) -> Path:
    """The repository when its flows exist, else a tmp copy of infra/ with placeholder flows."""
    if all((REPO / f).is_file() for f in FLOW_FILES):
        return REPO
    work = tmp_path / "project"
    (work / "infra").mkdir(parents=True)
    shutil.copy(PREFECT_FILE, work / "infra" / "prefect.yaml")
    for rel, src in _PLACEHOLDERS.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(textwrap.dedent(src), encoding="utf-8")
    return work


def _prefect(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "prefect", *args]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, (
        f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def test_prefect_yaml_declares_both_schedules():
    spec = yaml.safe_load(PREFECT_FILE.read_text(encoding="utf-8"))
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"nightly-router-retraining", "batch-inference"}
    assert deps["nightly-router-retraining"]["entrypoint"] == "flows/pipeline.py:pipeline_flow"
    assert deps["batch-inference"]["entrypoint"] == "flows/batch_inference.py:batch_inference_flow"
    for d in deps.values():
        assert d["work_pool"]["name"] == "local-pool"
        assert d["parameters"]["params_path"] == "params.yaml"


@pytest.mark.slow
def test_deploy_all_registers_scheduled_deployments(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    assert api_url, "the prefect_server fixture should set PREFECT_API_URL"
    work = _workdir(tmp_path)
    env = os.environ | {
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(tmp_path / "prefect_home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": str(work),
    }
    _prefect(["work-pool", "create", "local-pool", "--type", "process", "--overwrite"], work, env)
    before = (work / "infra" / "prefect.yaml").read_bytes()
    _prefect(["--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"], work, env)
    # --no-prompt deploy never rewrites the file (it runs in the repository once the real flows exist).
    assert (work / "infra" / "prefect.yaml").read_bytes() == before

    async def read() -> dict:
        async with get_client() as client:
            deps = await client.read_deployments()
            return {d.name: d for d in deps}

    deps = asyncio.run(read())
    nightly, batch = deps["nightly-router-retraining"], deps["batch-inference"]

    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert [s.schedule.cron for s in batch.schedules] == ["15 * * * *"]
    assert all(s.active and s.schedule.timezone == "UTC" for s in nightly.schedules + batch.schedules)
    assert nightly.parameters == {"params_path": "params.yaml"}
    assert batch.parameters == {
        "params_path": "params.yaml",
        "input": "data/embedded/math_test.jsonl",
        "output": "outputs/predictions.jsonl",
    }
    for d in (nightly, batch):
        assert d.work_pool_name == "local-pool"
        assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1
        # The working directory stays a template, filled from the worker's environment at run time.
        assert d.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $CITER_ROOT }}"}}
        ]
    assert nightly.entrypoint == "flows/pipeline.py:pipeline_flow"
    assert batch.entrypoint == "flows/batch_inference.py:batch_inference_flow"
    # The parameter schema comes from the flow's signature: a run with a wrong parameter name is refused.
    assert set(batch.parameter_openapi_schema["properties"]) >= {"params_path", "input", "output"}


# ----------------------------------------------------------------------------------------------------------------
# infra/docker-compose.yml: docker is not available here, so the wiring between services is checked on the parsed file.

COMPOSE_FILE = REPO / "infra" / "docker-compose.yml"


# What a user must set before `docker compose up` (``${VAR:?message}``: compose refuses to start without it).
REQUIRED = {"CITER_DB_PASSWORD": "pw"}


def _expand(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the variables unset, as on a fresh machine, and ``${VAR:?...}`` with the
    required ones set."""
    import re

    return re.sub(
        r"\$\{(\w+)(?::([-?])([^}]*))?\}",
        lambda m: REQUIRED[m.group(1)] if m.group(2) == "?" else (m.group(3) or ""),
        value,
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    spec = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return {name: svc for name, svc in spec["services"].items()} | {"__volumes__": spec.get("volumes", {})}


def _env(svc: dict) -> dict[str, str]:
    return {k: _expand(str(v)) for k, v in (svc.get("environment") or {}).items()}


def _command(svc: dict) -> list[str]:
    return [_expand(str(c)) for c in svc["command"]]


def test_compose_has_no_default_password_and_binds_loopback(compose):
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert "${CITER_DB_PASSWORD:?" in text and "CITER_DB_PASSWORD:-" not in text
    for name in ("mlflow", "prefect-server"):
        assert all(str(p).startswith("127.0.0.1:") for p in compose[name].get("ports", [])), name


def _published(svc: dict) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for p in svc.get("ports", []):
        host, container = str(p).split(":")[-2:]
        out[int(container)] = int(host)
    return out


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_compose_services_and_ports(compose):
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(compose)
    prefect_cmd = _command(compose["prefect-server"])
    assert prefect_cmd[:3] == ["prefect", "server", "start"] and _flag(prefect_cmd, "--host") == "0.0.0.0"
    assert _published(compose["prefect-server"]) == {int(_flag(prefect_cmd, "--port")): 4200}
    mlflow_cmd = _command(compose["mlflow"])
    assert mlflow_cmd[:2] == ["mlflow", "server"] and _flag(mlflow_cmd, "--host") == "0.0.0.0"
    assert _published(compose["mlflow"]) == {int(_flag(mlflow_cmd, "--port")): 5000}
    assert _expand(compose["prefect-server"]["image"]).startswith("prefecthq/prefect:3")


def test_compose_databases_are_wired_to_postgres(compose):
    from urllib.parse import urlsplit

    pg = _env(compose["postgres"])
    prefect_db = urlsplit(_env(compose["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"])
    mlflow_db = urlsplit(_flag(_command(compose["mlflow"]), "--backend-store-uri"))
    for url, scheme in ((prefect_db, "postgresql+asyncpg"), (mlflow_db, "postgresql+psycopg2")):
        assert url.scheme == scheme and url.hostname == "postgres" and url.port == 5432
        assert (url.username, url.password) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])
    assert prefect_db.path == f"/{pg['POSTGRES_DB']}"
    # The MLflow database is not POSTGRES_DB, so the init script mounted into postgres must create it.
    mounts = {m.split(":")[1]: m.split(":")[0] for m in compose["postgres"]["volumes"]}
    init = [src for dst, src in mounts.items() if dst.startswith("/docker-entrypoint-initdb.d/")]
    assert len(init) == 1
    sql = (COMPOSE_FILE.parent / init[0]).read_text(encoding="utf-8")
    assert f"CREATE DATABASE {mlflow_db.path.lstrip('/')}" in sql
    for svc in ("prefect-server", "mlflow"):
        assert compose[svc]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_compose_worker_points_at_both_servers(compose):
    import fnmatch
    from urllib.parse import urlsplit

    worker = compose["worker"]
    env = _env(worker)
    prefect_cmd, mlflow_cmd = _command(compose["prefect-server"]), _command(compose["mlflow"])
    api = urlsplit(env["PREFECT_API_URL"])
    assert (api.hostname, api.port, api.path) == ("prefect-server", int(_flag(prefect_cmd, "--port")), "/api")
    tracking = urlsplit(env["MLFLOW_TRACKING_URI"])
    assert (tracking.hostname, tracking.port) == ("mlflow", int(_flag(mlflow_cmd, "--port")))
    # MLflow 3 refuses Host headers outside its allow-list: the worker's must be on it.
    allowed = _flag(mlflow_cmd, "--allowed-hosts").split(",")
    assert any(fnmatch.fnmatch(tracking.netloc, pat) for pat in allowed)
    worker_cmd = worker["command"]
    pools = {d["work_pool"]["name"] for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}
    assert worker_cmd[:3] == ["prefect", "worker", "start"] and {_flag(worker_cmd, "--pool")} == pools
    assert _flag(worker_cmd, "--type") == "process"
    assert env["CITER_ROOT"] == "/opt/citer"
    assert {s for s, c in worker["depends_on"].items() if c["condition"] == "service_healthy"} == {
        "prefect-server",
        "mlflow",
    }
    for svc in ("prefect-server", "mlflow", "worker"):
        e = _env(compose[svc])
        assert e["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and e["MLFLOW_DISABLE_TELEMETRY"] == "true"


def test_compose_volumes_and_build(compose):
    declared = set(compose["__volumes__"])
    for name, svc in compose.items():
        if name == "__volumes__":
            continue
        for m in svc.get("volumes", []):
            src = m.split(":")[0]
            if not src.startswith((".", "/")):
                assert src in declared, f"{name}: volume {src} not declared"
    artifacts = _flag(_command(compose["mlflow"]), "--artifacts-destination")
    assert any(m.split(":")[1] == artifacts for m in compose["mlflow"]["volumes"])
    for svc in ("mlflow", "worker"):
        build = compose[svc]["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == REPO and (context / build["dockerfile"]).is_file()


def test_dockerfile_installs_pinned_cpu_torch():
    text = (REPO / "infra" / "Dockerfile").read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "-c constraints.txt" in text
    assert "ENV" in text and "CITER_ROOT=/opt/citer" in text
    # Every COPY source exists, so the build does not fail on a renamed file.
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies missing {src}"


@pytest.mark.slow
def test_worker_runs_a_deployment_in_citer_root(prefect_server, tmp_path):
    """The pull step of infra/prefect.yaml, for real: a process worker runs the flow in the worker's $CITER_ROOT."""
    from prefect.settings import PREFECT_API_URL

    pull = yaml.safe_load(PREFECT_FILE.read_text(encoding="utf-8"))["pull"]
    code, root = tmp_path / "code", tmp_path / "root"
    code.mkdir()
    root.mkdir()
    (code / "probe.py").write_text(
        textwrap.dedent("""
            import os
            from pathlib import Path
            from prefect import flow

            @flow(name="cwd-probe")
            def probe(tag: str = "x") -> None:
                Path("probe.txt").write_text(f"{tag} {os.getcwd()}")
        """),
        encoding="utf-8",
    )
    spec = {
        "name": "probe",
        "pull": pull,
        "deployments": [
            {
                "name": "probe",
                "entrypoint": "probe.py:probe",
                "parameters": {"tag": "ran"},
                "work_pool": {"name": "probe-pool"},
            }
        ],
    }
    (code / "prefect.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    env = os.environ | {
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_HOME": str(tmp_path / "prefect_home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    _prefect(["work-pool", "create", "probe-pool", "--type", "process", "--overwrite"], code, env)
    _prefect(["--no-prompt", "deploy", "--all"], code, env)
    _prefect(["deployment", "run", "cwd-probe/probe"], code, env)
    # The worker starts in root/, where there is no flow file: it finds probe.py only by moving to $CITER_ROOT.
    worker_env = env | {"CITER_ROOT": str(code)}
    _prefect(["worker", "start", "--pool", "probe-pool", "--run-once"], root, worker_env)
    out = code / "probe.txt"
    assert out.is_file(), "the worker did not run the flow in CITER_ROOT"
    assert out.read_text() == f"ran {code}"
