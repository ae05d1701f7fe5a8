"""The MLflow Model Registry side of the router: register a version, read the champion, move the alias.

A router version is a pyfunc model logged *from code* (``citer/routing/pyfunc.py``), so nothing is pickled: its only
artifact is the router directory (``router.safetensors`` + ``router.json``); its ``model_config`` names the SLM and
LLM by reference and τ, so ``mlflow.pyfunc.load_model('models:/<name>@champion').predict(prompts)`` generates text.
Version tags carry what a deployment needs to rebuild the decoder: the SLM, the LLM, τ, the hidden size, the label
iteration, the data version and the git commit, plus the sweep metrics at the chosen τ
(:func:`citer.evaluation.promotion.version_tags`). Whether a version takes the alias is decided by
:mod:`citer.evaluation.promotion`; this module carries the decision out.

Portability: citer records models and files relative to the project root (:meth:`citer.project.Project.portable_ref`).
MLflow itself cannot: ``create_experiment`` makes a relative artifact location absolute against the current
directory, and every run, logged model and model version copies that absolute prefix. So a project's own sqlite store
is *rebased* when it is opened (:func:`open_store`): when its experiments point at ``<old root>/<mlflow_artifacts>``
and the project now lives elsewhere (copied or moved), every stored ``<old root>/`` prefix becomes the new root and the
file is vacuumed, so the copy logs into, and loads from, its own ``mlartifacts``.
"""

from __future__ import annotations

import json
import re
import sqlite3
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from citer.project import Project

PYFUNC_CODE = Path(__file__).parent / "routing" / "pyfunc.py"
PIP_REQUIREMENTS = ["torch==2.13.0", "safetensors", "mlflow==3.17.2"]


class RegistryError(ValueError):
    """A registry state the user must fix (no champion yet, models gone); the message says how."""


def _own_sqlite(proj: Project) -> Path | None:
    """The project's sqlite store file when it lies inside the project (a store shared from outside is left alone)."""
    uri = proj.tracking_uri
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///") :])
    try:
        db.resolve().relative_to(proj.root.resolve())
    except ValueError:
        return None
    return db if db.is_file() else None


def _local_path(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def _text_columns(con: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = con.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
        "AND sql NOT LIKE 'CREATE VIRTUAL%'"
    ).fetchall()
    out = []
    for (table,) in tables:
        for _, col, typ, *_ in con.execute(f'PRAGMA table_info("{table}")'):
            if any(t in (typ or "").upper() for t in ("CHAR", "TEXT", "CLOB")):
                out.append((table, col))
    return out


def _substitute(old: str, new: str) -> Any:
    """A replacer of the path prefix ``old``: not preceded by a path character, followed by a separator, a quote or
    the end. Inside a ``file://`` URI the root is percent-encoded (a space is %20), elsewhere it is plain."""
    forms = sorted({re.escape(old), re.escape(quote(old))}, key=len, reverse=True)
    pat = re.compile(r"(?<![\w.~%-])(file://)?(" + "|".join(forms) + r")(?=/|$|\"|')")

    def sub(value: str | None) -> str | None:
        if value is None:
            return None
        return pat.sub(lambda m: m.group(1) + quote(new) if m.group(1) else new, value)

    return sub


def rebase_store(db: str | Path, root: Path, artifacts: str) -> list[str]:
    """Rewrite a copied project's store onto ``root``; returns the old roots replaced (none: nothing to do).

    An old root is the directory above ``artifacts`` (params ``paths.mlflow_artifacts``) in an experiment's artifact
    location, when it is not ``root``. Only whole path prefixes are replaced (``/a/proj/`` never touches
    ``/a/proj2/``), in every text column, so no stored string keeps naming the original.
    """
    rel = Path(artifacts)
    if rel.is_absolute():
        return []
    new_root = str(root.resolve())
    con = sqlite3.connect(str(db))
    try:
        olds = set()
        for (loc,) in con.execute("SELECT artifact_location FROM experiments"):
            path = Path(unquote(_local_path(loc or "")))
            if path.is_absolute() and path.parts[-len(rel.parts) :] == rel.parts:
                old = str(path.parents[len(rel.parts) - 1])
                if old != new_root and len(old) > 1:
                    olds.add(old)
        if not olds:
            return []
        for old in sorted(olds, key=len, reverse=True):
            con.create_function("citer_rebase", 1, _substitute(old, new_root))
            with con:
                for table, col in _text_columns(con):
                    con.execute(
                        f'UPDATE "{table}" SET "{col}" = citer_rebase("{col}") '
                        f'WHERE instr("{col}", ?) > 0 OR instr("{col}", ?) > 0',
                        (old, quote(old)),
                    )
        con.execute("VACUUM")  # else the old strings stay readable in freed pages
        return sorted(olds)
    finally:
        con.close()


def open_store(proj: Project) -> str:
    """The project's tracking URI, its own sqlite store first rebased onto this root (see the module docstring)."""
    db = _own_sqlite(proj)
    if db is not None:
        rebase_store(db, proj.root, proj.params.paths.mlflow_artifacts)
    return proj.tracking_uri


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


# What the generating model's predict returns per prompt (citer/routing/pyfunc.py), as its logged signature says.
OUTPUT_COLUMNS: dict[str, str] = {
    "text": "string",
    "answer": "string",
    "n_tokens": "long",
    "llm_tokens": "long",
    "llm_token_fraction": "double",
    "llm_calls": "long",
    "bytes_moved": "double",
}
PREDICT_PARAMS: dict[str, tuple[str, Any]] = {"max_new_tokens": ("long", 128), "tau": ("double", -1.0)}


def generator_signature() -> Any:
    """One string column in (named ``prompt`` in a DataFrame, or a plain list of strings); text, the answer (empty
    when none is found) and routing stats out. Unnamed, so MLflow's schema check lets a list through as well."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec(t, name) for name, t in OUTPUT_COLUMNS.items()]),
        params=ParamSchema([ParamSpec(k, t, d) for k, (t, d) in PREDICT_PARAMS.items()]),
    )


def generator_config(proj: Project, tau: float, tags: dict[str, Any]) -> dict[str, Any]:
    """The generating model's config for a version of ``proj``: its pair by reference, τ and the serve settings."""
    p = proj.params
    fmt = p.data.format if p.serve.prompt_format == "auto" else p.serve.prompt_format
    return {
        "slm": str(tags["slm"]),
        "llm": str(tags["llm"]),
        "tau": float(tau),
        "prompt_format": fmt,
        "answer_format": p.data.format,
        "max_new_tokens": int(p.serve.max_new_tokens),
        "dtype": p.models.dtype,
        "device": p.models.device,
    }


def _pyfunc_config(tags: dict[str, str], model_config: dict[str, Any] | None) -> dict[str, Any]:
    """The generating model's config: the SLM, LLM and τ of the tags unless ``model_config`` says more."""
    cfg: dict[str, Any] = {k: tags[k] for k in ("slm", "llm") if k in tags}
    if "tau" in tags:
        cfg["tau"] = float(tags["tau"])
    cfg.update(model_config or {})
    cfg.setdefault("project_root", "")  # MLflow lets a loader override only the keys logged: empty = unset
    return cfg


def register_router(
    router_dir: str | Path,
    *,
    model_name: str,
    run_id: str,
    tags: dict[str, Any],
    tracking_uri: str | None = None,
    model_config: dict[str, Any] | None = None,
) -> RouterVersion:
    """Log ``router_dir`` as a generating pyfunc model in ``run_id`` and register it as a new version of ``model_name``.

    ``model_config`` (see ``citer/routing/pyfunc.py``) defaults to the tags' slm, llm and tau; model refs in it should
    be hub ids or project-relative paths, never absolute paths inside the project.
    """
    import mlflow

    router_dir = Path(router_dir)
    for f in ("router.safetensors", "router.json"):
        if not (router_dir / f).is_file():
            raise RegistryError(f"{router_dir}: missing {f}; train the router first (dvc stage router_*)")
    client = _client(tracking_uri)
    str_tags = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in tags.items()}
    with mlflow.start_run(run_id=run_id), warnings.catch_warnings():
        # An input example would make MLflow load the SLM and LLM to validate it; the signature says the schema.
        warnings.filterwarnings("ignore", message=".*(input example|input_example|type hints).*")
        info = mlflow.pyfunc.log_model(
            name="router",
            python_model=str(PYFUNC_CODE),
            artifacts={"router_dir": str(router_dir)},
            model_config=_pyfunc_config(str_tags, model_config),
            signature=generator_signature(),
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


def require_champion(
    model_name: str, alias: str, tracking_uri: str | None = None, root: Path | None = None
) -> RouterVersion:
    """The champion, or a RegistryError telling which stage to run; also checks that its models still exist.

    Relative model paths in its tags resolve against ``root`` (the project root; default the current directory).
    """
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        raise RegistryError(
            f"no router holds the alias '{alias}' of registered model '{model_name}': run the sweep stage "
            "first (`citer eval sweep` or `dvc repro sweep`)"
        )
    for role in ("slm", "llm"):
        ref = rv.tags.get(role, "")
        p = Path(ref)
        local = p if p.is_absolute() else Path(root or ".") / p
        expected_local = p.is_absolute() or ref.startswith(".") or _local_dir_expected(ref, root)
        if ref and expected_local and not local.exists():
            where = f" under {root}" if root is not None and not p.is_absolute() else ""
            raise RegistryError(
                f"router '{model_name}' v{rv.version} (@{alias}) names {role.upper()} {ref}, which no longer "
                f"exists{where}"
            )
    return rv


def _local_dir_expected(ref: str, root: Path | None) -> bool:
    """A relative ref whose first component is a directory of the project (``models/slm`` with ``models/``)."""
    if root is None or not ref or Path(ref).is_absolute():
        return False
    return (root / Path(ref).parts[0]).is_dir()


def load_router_version(rv: RouterVersion, slm: Any = None):
    """A version's router from its ``router_dir`` artifact: an MLPRouter on the hidden state alone (no models loaded),
    or, for a router on more inputs, a FeatureRouter that shares ``slm``'s head and embedding (``slm`` required)."""
    import tempfile

    import mlflow

    from citer.routing.mlp import load_router

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow.artifacts.download_artifacts(f"models:/{rv.name}/{rv.version}", dst_path=tmp))
        spec = mlflow.models.Model.load(str(local)).flavors["python_function"]["artifacts"]["router_dir"]
        router, _ = load_router(local / spec["path"], slm=slm)
    return router


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


def _same_model(a: str, b: str, root: Path | None) -> bool:
    if a == b:
        return True
    if root is None:
        return False
    pa, pb = root / a, root / b  # an absolute ref stays itself under ``/``
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def champion_to_compare(
    model_name: str,
    alias: str,
    *,
    slm: str,
    hidden_size: int,
    tracking_uri: str | None = None,
    root: Path | None = None,
    slm_model: Any = None,
) -> ChampionToCompare:
    """The champion, re-usable in a sweep only when it was registered for the same SLM and hidden size.

    With ``root`` an SLM recorded relative to the project and the same directory named absolutely are the same.
    ``slm_model`` (the loaded SLM) lets a champion that reads more than the hidden state be rebuilt on it.
    """
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        return ChampionToCompare(None, None, "no champion yet")
    if not _same_model(rv.tags.get("slm", ""), slm, root):
        return ChampionToCompare(
            rv, None, f"champion v{rv.version} routes for SLM {rv.tags.get('slm')}, not {slm}"
        )
    router = load_router_version(rv, slm=slm_model)
    if router.hidden_size != hidden_size:
        note = f"champion v{rv.version} has hidden_size {router.hidden_size}, the SLM {hidden_size}"
        return ChampionToCompare(rv, None, note)
    return ChampionToCompare(
        rv, router, f"champion v{rv.version} re-evaluated: τ chosen on dev, compared on test"
    )


def publish_router(
    router_dir: str | Path,
    *,
    model_name: str,
    alias: str,
    run_id: str,
    tags: dict[str, Any],
    promote: bool,
    tracking_uri: str | None = None,
    model_config: dict[str, Any] | None = None,
) -> RouterVersion:
    """Register ``router_dir`` as a new version and, when ``promote``, move ``alias`` to it."""
    rv = register_router(
        router_dir,
        model_name=model_name,
        run_id=run_id,
        tags=tags,
        tracking_uri=tracking_uri,
        model_config=model_config,
    )
    if promote:
        set_alias(model_name, alias, rv.version, tracking_uri)
    return rv
