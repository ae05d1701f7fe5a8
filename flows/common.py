"""What every stage flow shares: the project root, params, quiet tool defaults and MLflow run handling.

MLflow's active-run stack is thread-local and Prefect runs tasks in worker threads, so stages log through an explicit
:class:`StageRun` (client + run id) instead of the fluent ``mlflow.log_*`` API.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from citer.config import Params, load_params

QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # model saves/loads; citer's own long loops keep their bars
    "TRANSFORMERS_VERBOSITY": "error",
}
QUIET_LOGGERS = ("mlflow", "great_expectations", "alembic", "DeepSpeed")


def quiet_defaults(root: Path | None = None) -> None:
    """Telemetry off and tool state inside the project unless the user set it (two projects never share it)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    root = root or project_root()
    os.environ.setdefault("PREFECT_HOME", str(root / ".state" / "prefect"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".state" / "torch_extensions"))
    # Prefect creates its home without parents and then fails to start its temporary server.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    import logging

    import torch

    if not torch.cuda.is_available():  # else DeepSpeed (imported by transformers) warns on every start
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def project_root() -> Path:
    """The project directory: ``CITER_ROOT`` if set, else the current directory."""
    return Path(os.environ.get("CITER_ROOT", os.getcwd())).resolve()


@dataclass(frozen=True)
class Context:
    """A stage's view of the project: its root directory and its params."""

    root: Path
    params: Params

    def path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def model_ref(self, name: str) -> str:
        """A model directory under the project when it exists there, else the name as given (a hub id)."""
        local = self.path(name)
        return str(local) if local.exists() else name

    @property
    def slm_name(self) -> str:
        """The SLM as params name it (project-relative), the identity routers and labels record."""
        m = self.params.models
        return m.finetuned_slm if self.params.finetune.enabled else m.slm

    @property
    def slm_ref(self) -> str:
        """The SLM that routing uses: the finetuned one unless finetuning is off."""
        return self.model_ref(self.slm_name)

    @property
    def llm_ref(self) -> str:
        return self.model_ref(self.params.models.llm)

    def labels_dir(self, iteration: int | str) -> Path:
        return self.path(self.params.paths.labels_dir) / (
            f"iter{iteration}" if isinstance(iteration, int) else iteration
        )

    def router_dir(self, iteration: int | str) -> Path:
        return self.path(self.params.paths.routers_dir) / (
            f"iter{iteration}" if isinstance(iteration, int) else iteration
        )

    @property
    def reports(self) -> Path:
        return self.path(self.params.paths.reports_dir)

    def load_pair(self):
        """``(slm, llm, tokenizer)`` as params say (dtype, device, remote code)."""
        from citer.models import load_pair

        m = self.params.models
        return load_pair(self.slm_ref, self.llm_ref, m.dtype, m.device, m.trust_remote_code)

    def read_split(self, split: str) -> list[dict[str, Any]]:
        from citer.data.formats import read_jsonl

        d = self.params.data
        return read_jsonl(self.path(getattr(d, split)), d.format)


def load_context(params_path: str | os.PathLike[str] = "params.yaml", optional: bool = False) -> Context:
    """The project's context; with ``optional`` a missing params file means the defaults (a malformed one never)."""
    root = project_root()
    p = Path(params_path)
    p = p if p.is_absolute() else root / p
    if optional and not p.exists():
        return Context(root=root, params=Params())
    return Context(root=root, params=load_params(p))


def tracking_uri(ctx: Context) -> str:
    """``MLFLOW_TRACKING_URI`` wins; else params, with a relative sqlite path made absolute against the root."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or ctx.params.paths.mlflow_tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        uri = prefix + str(ctx.root / uri[len(prefix) :])
    return uri


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class StageRun:
    """An MLflow run addressed by id, safe to use from any thread."""

    client: Any
    run_id: str
    experiment_id: str

    def params(self, values: Mapping[str, Any], prefix: str = "") -> None:
        from mlflow.entities import Param

        flat = flatten(values, prefix)
        items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def metrics(self, values: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(k, float(v), ts, step or 0)
            for k, v in flatten(values).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def curve(self, name: str, values: list[float]) -> None:
        for step, v in enumerate(values):
            self.metrics({name: v}, step=step)

    def tags(self, values: Mapping[str, Any]) -> None:
        for k, v in values.items():
            self.client.set_tag(self.run_id, k, str(v))

    def artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        elif p.exists():
            self.client.log_artifact(self.run_id, str(p), artifact_path)


def ensure_experiment(ctx: Context) -> str:
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(ctx))
    client = mlflow.MlflowClient()
    name = ctx.params.registry.experiment
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        if tracking_uri(ctx).startswith(("http://", "https://")):
            return client.create_experiment(name)  # the server's own (proxied) artifact store
        artifacts = ctx.path(ctx.params.paths.mlflow_artifacts)
        artifacts.mkdir(parents=True, exist_ok=True)
        return client.create_experiment(name, artifact_location=artifacts.as_uri())
    except Exception:  # another process created it between the lookup and the create
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def stage_run(ctx: Context, stage: str, parent_run_id: str | None = None) -> Iterator[StageRun]:
    """One MLflow run for a stage, nested under ``parent_run_id`` (or ``CITER_PARENT_RUN_ID``) when given."""
    import mlflow
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    exp_id = ensure_experiment(ctx)
    client = mlflow.MlflowClient()
    parent = parent_run_id or os.environ.get("CITER_PARENT_RUN_ID")
    tags = {MLFLOW_RUN_NAME: stage, "citer.stage": stage, "git_commit": git_commit(ctx.root)}
    if parent:
        tags[MLFLOW_PARENT_RUN_ID] = parent
    run = client.create_run(exp_id, tags=tags, run_name=stage)
    sr = StageRun(client=client, run_id=run.info.run_id, experiment_id=exp_id)
    try:
        yield sr
    except BaseException:
        client.set_terminated(sr.run_id, status="FAILED")
        raise
    client.set_terminated(sr.run_id, status="FINISHED")
