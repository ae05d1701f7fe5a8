"""The MLflow Model Registry side of the router: register a version, read the champion, move the alias.

A router version is a pyfunc model logged *from code* (``citer/routing/pyfunc.py``), so nothing is pickled: its only
artifact is the router directory (``router.safetensors`` + ``router.json``). Version tags carry what a deployment
needs to rebuild the decoder: the SLM, the LLM, τ, the hidden size, the label iteration, the data version and the git
commit, plus the sweep metrics at the chosen τ (:func:`citer.evaluation.promotion.version_tags`). Whether a version
takes the alias is decided by :mod:`citer.evaluation.promotion`; this module carries the decision out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PYFUNC_CODE = Path(__file__).parent / "routing" / "pyfunc.py"
PIP_REQUIREMENTS = ["torch==2.13.0", "safetensors", "mlflow==3.17.2"]


class RegistryError(ValueError):
    """A registry state the user must fix (no champion yet, models gone); the message says how."""


@dataclass(frozen=True)
class RouterVersion:
    name: str
    version: str
    tags: dict[str, str]
    source: str

    @property
    def tau(self) -> float:
        return float(self.tags["tau"])


def _client(tracking_uri: str | None = None):
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    return mlflow.MlflowClient()


def register_router(
    router_dir: str | Path,
    *,
    model_name: str,
    run_id: str,
    tags: dict[str, Any],
    tracking_uri: str | None = None,
) -> RouterVersion:
    """Log ``router_dir`` as a pyfunc model in ``run_id`` and register it as a new version of ``model_name``."""
    import mlflow

    router_dir = Path(router_dir)
    for f in ("router.safetensors", "router.json"):
        if not (router_dir / f).is_file():
            raise RegistryError(f"{router_dir}: missing {f}; train the router first (dvc stage router_*)")
    client = _client(tracking_uri)
    str_tags = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in tags.items()}
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="router",
            python_model=str(PYFUNC_CODE),
            artifacts={"router_dir": str(router_dir)},
            pip_requirements=PIP_REQUIREMENTS,
            metadata={k: str_tags[k] for k in sorted(str_tags)},
        )
    try:
        client.create_registered_model(model_name)
    except Exception as exc:  # already exists
        if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    mv = client.create_model_version(model_name, info.model_uri, run_id=run_id, tags=str_tags)
    return RouterVersion(name=model_name, version=str(mv.version), tags=str_tags, source=info.model_uri)


def get_alias(model_name: str, alias: str, tracking_uri: str | None = None) -> RouterVersion | None:
    """The version holding ``alias``, or None when the model or the alias does not exist."""
    client = _client(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(model_name, alias)
    except Exception:
        return None
    return RouterVersion(name=model_name, version=str(mv.version), tags=dict(mv.tags), source=mv.source)


def set_alias(model_name: str, alias: str, version: str, tracking_uri: str | None = None) -> None:
    _client(tracking_uri).set_registered_model_alias(model_name, alias, version)


def require_champion(model_name: str, alias: str, tracking_uri: str | None = None) -> RouterVersion:
    """The champion, or a RegistryError telling which stage to run; also checks that its models still exist."""
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        raise RegistryError(
            f"no router holds the alias '{alias}' of registered model '{model_name}': run the sweep stage "
            "first (`citer eval sweep` or `dvc repro sweep`)"
        )
    for role in ("slm", "llm"):
        path = rv.tags.get(role, "")
        if path.startswith(("/", ".")) and not Path(path).exists():
            raise RegistryError(
                f"router '{model_name}' v{rv.version} (@{alias}) names {role.upper()} {path}, which no longer exists"
            )
    return rv


def load_router_version(rv: RouterVersion):
    """Download a version's router directory and load it as an MLPRouter (pyfunc artifacts, no pickle)."""
    import mlflow

    model = mlflow.pyfunc.load_model(f"models:/{rv.name}/{rv.version}")
    return model.unwrap_python_model().router


@dataclass(frozen=True)
class ChampionToCompare:
    """The version holding the alias and, when it routes for this SLM, its router to re-evaluate in the sweep."""

    version: RouterVersion | None  # None: no champion yet
    router: Any | None  # None: no champion, or one that cannot run on this SLM (``note`` says why)
    note: str

    @property
    def router_and_tau(self) -> tuple[Any, float] | None:
        if self.version is None or self.router is None:
            return None
        return self.router, self.version.tau


def champion_to_compare(
    model_name: str, alias: str, *, slm: str, hidden_size: int, tracking_uri: str | None = None
) -> ChampionToCompare:
    """The champion, re-usable in a sweep only when it was registered for the same SLM and hidden size."""
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        return ChampionToCompare(None, None, "no champion yet")
    if rv.tags.get("slm") != slm:
        return ChampionToCompare(
            rv, None, f"champion v{rv.version} routes for SLM {rv.tags.get('slm')}, not {slm}"
        )
    router = load_router_version(rv)
    if router.hidden_size != hidden_size:
        note = f"champion v{rv.version} has hidden_size {router.hidden_size}, the SLM {hidden_size}"
        return ChampionToCompare(rv, None, note)
    return ChampionToCompare(rv, router, f"champion v{rv.version} re-evaluated at tau={rv.tau}")


def publish_router(
    router_dir: str | Path,
    *,
    model_name: str,
    alias: str,
    run_id: str,
    tags: dict[str, Any],
    promote: bool,
    tracking_uri: str | None = None,
) -> RouterVersion:
    """Register ``router_dir`` as a new version and, when ``promote``, move ``alias`` to it."""
    rv = register_router(
        router_dir, model_name=model_name, run_id=run_id, tags=tags, tracking_uri=tracking_uri
    )
    if promote:
        set_alias(model_name, alias, rv.version, tracking_uri)
    return rv
