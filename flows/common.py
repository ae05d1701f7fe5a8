"""What every stage flow shares: quiet tool defaults and MLflow run handling (the project itself: citer.project).

MLflow's active-run stack is thread-local and Prefect runs tasks in worker threads, so stages log through an explicit
:class:`StageRun` (client + run id) instead of the fluent ``mlflow.log_*`` API.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from citer.project import Project, load_project, project_root
from citer.tracking.provenance import git_head

QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables..." on every new store
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # An unreachable tracking server fails the stage in about a minute, not after MLflow's default ~4 minutes of
    # retries (the registry fails closed either way).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # model saves/loads; citer's own long loops keep their bars
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Loggers that speak at INFO about their own plumbing. A filter, not a level: some of them (Great Expectations'
# data_context.types.base) set their own level to INFO when imported, which would undo a level set here.
QUIET_LOGGERS = (
    "mlflow",
    "great_expectations",
    "great_expectations.data_context.types.base",
    "alembic",
    "DeepSpeed",
    "docket",
    "httpx",
)
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


# Library notes that are not the user's to act on. MLflow's warns whenever the router's pyfunc class is defined (its
# predict is untyped on purpose: MLflow would read type hints as the input schema), under its own "once" filter, so
# a warnings filter cannot hold it back; it is dropped where it is shown (stderr, or logging when Prefect captures).
NOISE = ("Add type hints to the `predict` method",)


def _is_noise(text: str) -> bool:
    return any(n in text for n in NOISE)


def _drop_noise() -> None:
    shown = warnings.showwarning
    if getattr(shown, "citer_quiet", False):
        return

    def showwarning(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ):
        if not _is_noise(str(message)):
            shown(message, category, filename, lineno, file, line)

    showwarning.citer_quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
    captured = logging.getLogger("py.warnings")
    if not any(getattr(f, "citer_quiet", False) for f in captured.filters):
        keep = lambda record: not _is_noise(record.getMessage())  # noqa: E731
        keep.citer_quiet = True  # type: ignore[attr-defined]
        captured.addFilter(keep)


def debug_enabled() -> bool:
    """``--debug`` or ``CITER_DEBUG=1``: tracebacks and the tools' own logs are shown."""
    return os.environ.get("CITER_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def _at_least(level: int) -> Callable[[logging.LogRecord], bool]:
    return lambda record: record.levelno >= level


def _below(level: int) -> Callable[[logging.LogRecord], bool]:
    return lambda record: record.levelno < level


def quiet_defaults(root: Path | None = None) -> None:
    """Telemetry and tool chatter off, tool state inside the project unless the user set it (two projects never
    share it). Cheap: nothing heavy is imported, so ``citer --help`` and quick commands start fast."""
    debug = debug_enabled()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # A failed task or flow run logs its traceback (ERROR) before the exception reaches the CLI, which prints it
    # once, in one line; --debug shows Prefect's account too.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if debug else "CRITICAL")
    for name in RUN_LOGGERS:  # when Prefect's logging was set up before this call (an embedding process)
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET if debug else logging.CRITICAL)
        # A user's own PREFECT_LOGGING_LEVEL (or Prefect configuring logging after this call) would bring the failed
        # run's traceback back; a filter outlives Prefect's logging config, so the error is said once, by the CLI.
        if not debug and not any(getattr(f, "citer_quiet", False) for f in logger.filters):
            below = _below(logging.ERROR)
            below.citer_quiet = True  # type: ignore[attr-defined]
            logger.addFilter(below)
    root = root or project_root()
    os.environ.setdefault("PREFECT_HOME", str(root / ".state" / "prefect"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".state" / "torch_extensions"))
    # Prefect creates its home without parents and then fails to start its temporary server.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    if not Path(
        "/proc/driver/nvidia"
    ).exists():  # no NVIDIA driver: DeepSpeed (imported by transformers) warns
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not debug:
        _drop_noise()
    for name in () if debug else QUIET_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        if not any(getattr(f, "citer_quiet", False) for f in logger.filters):
            keep = _at_least(logging.WARNING)
            keep.citer_quiet = True  # type: ignore[attr-defined]
            logger.addFilter(keep)


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


def ensure_experiment(proj: Project) -> str:
    """The project's experiment id, created with its artifacts in the project's own ``mlartifacts``.

    MLflow stores that location absolute; a copied or moved project's own store is rebased onto its new root first
    (:func:`citer.tracking.store.open_store`), so a copy never logs into the original's artifacts.
    """
    import mlflow

    from citer.tracking.store import open_store

    mlflow.set_tracking_uri(open_store(proj))
    client = mlflow.MlflowClient()
    name = proj.params.registry.experiment
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        if proj.tracking_uri.startswith(("http://", "https://")):
            return client.create_experiment(name)  # the server's own (proxied) artifact store
        artifacts = proj.path(proj.params.paths.mlflow_artifacts)
        artifacts.mkdir(parents=True, exist_ok=True)
        return client.create_experiment(name, artifact_location=artifacts.as_uri())
    except Exception:  # another process created it between the lookup and the create
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def stage_run(proj: Project, stage: str, parent_run_id: str | None = None) -> Iterator[StageRun]:
    """One MLflow run for a stage, nested under ``parent_run_id`` (or ``CITER_PARENT_RUN_ID``) when given."""
    import mlflow
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    from citer.ops import interrupt

    exp_id = ensure_experiment(proj)
    client = mlflow.MlflowClient()
    parent = parent_run_id or os.environ.get("CITER_PARENT_RUN_ID")
    tags = {MLFLOW_RUN_NAME: stage, "citer.stage": stage, "git_commit": git_head(proj.root)}
    tags |= _owner_tags()
    if "torch" in sys.modules:  # what the stage ran on (citer.ops.threads chose it)
        tags["citer.torch_threads"] = str(sys.modules["torch"].get_num_threads())
    if parent:
        tags[MLFLOW_PARENT_RUN_ID] = parent
    run = client.create_run(exp_id, tags=tags, run_name=stage)
    sr = StageRun(client=client, run_id=run.info.run_id, experiment_id=exp_id)
    # Ctrl-C whose unwinding hangs (citer.ops.interrupt) still closes the run: no stage leaves it RUNNING.
    token = interrupt.on_interrupt(lambda: client.set_terminated(sr.run_id, status="KILLED"))
    try:
        yield sr
    except BaseException as exc:
        killed = isinstance(exc, KeyboardInterrupt) or interrupt.interrupted() is not None
        client.set_terminated(sr.run_id, status="KILLED" if killed else "FAILED")
        raise
    finally:
        interrupt.done(token)
    client.set_terminated(sr.run_id, status="FINISHED")


OWNER_TAGS = ("citer.host", "citer.pid", "citer.pid_start")


def _owner_tags() -> dict[str, str]:
    """Which process holds a run open: a run still RUNNING whose process is gone was left by a SIGKILL."""
    import socket

    from citer.ops.reaper import ancestor_named, start_time

    tags = {
        "citer.host": socket.gethostname(),
        "citer.pid": str(os.getpid()),
        "citer.pid_start": start_time(),
    }
    # one `dvc repro` runs each stage as its own command: its runs share this tag
    if os.environ.get("DVC_STAGE"):
        dvc = ancestor_named("dvc")
        tags["citer.dvc_repro"] = f"{dvc.pid}-{start_time(dvc.pid)}" if dvc else "?"
    return tags


def close_orphan_runs(proj: Project) -> list[str]:
    """Mark ``KILLED`` the project's runs still ``RUNNING`` whose process on this machine is gone (a SIGKILL, an
    OOM kill: nothing in the process could close them). Call it holding the project lock. Returns their ids."""
    import socket

    if not _may_hold_running_runs(proj.tracking_uri):
        return []  # without importing MLflow and opening its store: a stage's first work starts seconds sooner
    import mlflow

    from citer.ops.reaper import alive
    from citer.tracking.store import open_store

    client = mlflow.MlflowClient(open_store(proj))
    exp = client.get_experiment_by_name(proj.params.registry.experiment)
    if exp is None:  # nothing logged yet (and nothing created here: a side run writes no store)
        return []
    host = socket.gethostname().replace("'", "")
    found = client.search_runs(
        [exp.experiment_id],
        f"attributes.status = 'RUNNING' and tags.`citer.host` = '{host}'",
        max_results=1000,
    )
    gone = []
    for run in found:
        t = run.data.tags
        pid, start = t.get("citer.pid", ""), t.get("citer.pid_start", "")
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid), start):
            client.set_terminated(run.info.run_id, status="KILLED")
            gone.append(run.info.run_id)
    return gone


def _may_hold_running_runs(uri: str) -> bool:
    """False when an sqlite tracking store is missing or has no run marked RUNNING (read with sqlite3 alone);
    True otherwise, or for any other store (MLflow itself then looks)."""
    import sqlite3

    if not uri.startswith("sqlite:///"):
        return True
    path = Path(uri.removeprefix("sqlite:///"))
    if not path.is_file():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute("SELECT 1 FROM runs WHERE status = 'RUNNING' LIMIT 1").fetchone() is not None
    except sqlite3.Error:
        return True


def owned_dirs(proj: Project) -> list[Path]:
    """The directories citer writes and may clean: reports, labels, routers, the route output's directory, and the
    models/data it makes itself (never a user's own model directories)."""
    p = proj.params
    dirs = [proj.reports, proj.path(p.paths.labels_dir), proj.path(p.paths.routers_dir)]
    dirs.append(proj.path(p.inference.output).parent)
    if p.synth.enabled:
        dirs.append(proj.path(p.paths.data_dir))
    if p.bootstrap.enabled:
        dirs.append(proj.path(p.paths.models_dir))
    if p.finetune.enabled:
        dirs.append(proj.path(p.models.finetuned_slm).parent)
    root = proj.root.resolve()
    return [
        d for d in dirs if d.resolve() != root and d.resolve().is_relative_to(root)
    ]  # never outside the project


def record_reports(proj: Project, stage: str, started: float) -> None:
    """Stamp the report files ``stage`` wrote since ``started`` in ``reports/provenance.json`` (what ran, where,
    from which commit and params, how long: :mod:`citer.tracking.provenance`)."""
    from citer.tracking.provenance import stamp_written

    stamp_written(
        proj.reports, started, stage=stage, root=proj.root, wall_s=time.time() - started, params=proj.params
    )


_DEPTH = [0]  # stage flows running inside one another in this process (a pipeline's stages)
TORCH_STAGES = frozenset(
    {"bootstrap", "finetune", "eval_models", "iterate", "labels", "router", "sweep", "route"}
)


def locked(
    what: str, side_run: Callable[..., bool] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a stage flow's body holding the project lock (``lock`` params), after removing what a killed run left.

    Place it under ``@flow``. The flow's first argument (or ``params_path=``) names the params file. The report
    files the body wrote are stamped in ``reports/provenance.json``, unless ``side_run`` (called with the flow's
    arguments by name) says this call is not the project's own stage (``citer route --output mine.jsonl``).
    """
    from citer.ops.locking import project_lock, remove_leftovers

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            params_path = kwargs.get("params_path", args[0] if args else "params.yaml")
            proj = load_project(params_path)
            if _DEPTH[0] == 0:  # a command's first stage: devices, dtypes, models and data before any work
                from citer.ops.preflight import preflight

                preflight(proj, params_path)
            lk = proj.params.lock
            say = functools.partial(print, file=sys.stderr)
            with project_lock(proj.root, what, wait=lk.wait, timeout_s=lk.timeout_s, say=say):
                # once per command: a pipeline's stages share its lock, and a stage inside it must not take the
                # command's own writers for a killed run's (the LLM's directory, written beside the finetune)
                if _DEPTH[0] == 0:
                    for p in remove_leftovers(owned_dirs(proj)):
                        say(f"removed {proj.portable_ref(p)}, left by a killed run")
                    for run_id in close_orphan_runs(proj):
                        say(f"marked MLflow run {run_id} KILLED: its process was killed while it ran")
                if what in TORCH_STAGES:
                    from citer.ops.threads import set_stage_threads

                    set_stage_threads(proj)
                started = time.time()
                _DEPTH[0] += 1
                try:
                    out = fn(*args, **kwargs)
                finally:
                    _DEPTH[0] -= 1
                if side_run is None or not side_run(inspect.signature(fn).bind(*args, **kwargs).arguments):
                    record_reports(proj, what, started)
                return out

        return wrapper

    return deco
