"""The MLflow Model Registry side of the router: register a version, read the champion, move the alias.

A router version is a pyfunc model logged *from code* (``citer/routing/pyfunc.py``), so nothing is pickled: its
artifacts are the router directory (``router.safetensors`` + ``router.json``) and its dev score quantiles (a JSON
file); its ``model_config`` names the SLM and LLM by reference and τ, so
``mlflow.pyfunc.load_model('models:/<name>@champion').predict(prompts)`` generates text.
Version tags carry what a deployment needs to rebuild the decoder: the SLM, the LLM, τ, the hidden size, the label
iteration, the data version and the git commit, plus the sweep metrics at the chosen τ
(:func:`citer.evaluation.promotion.version_tags`). Whether a version takes the alias is decided by
:mod:`citer.evaluation.promotion`; this module carries the decision out.

The project's own MLflow store (opening, rebasing a copied project) is :mod:`citer.tracking.store`; the alias
(reading it fail-closed, moving it only from the version compared, finishing an interrupted promotion) is
:mod:`citer.tracking.alias`; the champion a command deploys, with its τ, is :mod:`citer.tracking.deployed`.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from citer.ops.io import file_digest, write_json
from citer.project import Project
from citer.tracking.alias import get_alias, move_alias, set_alias
from citer.tracking.store import RegistryError, RouterVersion, _client

PYFUNC_CODE = Path(__file__).parents[1] / "routing" / "pyfunc.py"
PIP_REQUIREMENTS = ["torch==2.13.0", "safetensors", "mlflow==3.17.2"]


# Version tag: sha256 of each router file at registration; a load whose bytes differ is refused.
DIGEST_TAG = "router_sha256"
ROUTER_FILES = ("router.safetensors", "router.json")
# The router's dev score quantiles (τ at LLM fractions 0, 0.01, ..., 1: citer.evaluation.thresholds.quantile_table),
# a file logged with the version beside its router directory; the tag holds its sha256.
QUANTILES, QUANTILES_TAG = "dev_score_quantiles", "dev_score_quantiles_sha256"


def recorded_pair_of(router_dir: str | Path) -> dict[str, str]:
    """The ``slm_digest``/``llm_digest`` a router directory's ``router.json`` records (none when it records none)."""
    from citer.routing.pair_check import recorded_pair

    try:
        meta = json.loads((Path(router_dir) / "router.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return recorded_pair(meta) if isinstance(meta, dict) else {}


def router_digests(router_dir: str | Path) -> dict[str, str]:
    return {f: file_digest(Path(router_dir) / f) for f in ROUTER_FILES}


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
    } | {k: tags[k] for k in ("verify_rho", "verify_window", "verify_final") if k in tags}


def _pyfunc_config(tags: dict[str, str], model_config: dict[str, Any] | None) -> dict[str, Any]:
    """The generating model's config: the SLM, LLM and τ of the tags unless ``model_config`` says more."""
    cfg: dict[str, Any] = {k: tags[k] for k in ("slm", "llm") if k in tags}
    if "tau" in tags:
        cfg["tau"] = float(tags["tau"])
    cfg.update(model_config or {})
    cfg.setdefault("project_root", "")  # MLflow lets a loader override only the keys logged: empty = unset
    # a loader may set it to use the router with other model files
    cfg.setdefault("allow_pair_mismatch", False)
    return cfg


def register_router(
    router_dir: str | Path,
    *,
    model_name: str,
    run_id: str,
    tags: dict[str, Any],
    tracking_uri: str | None = None,
    model_config: dict[str, Any] | None = None,
    quantiles: Sequence[float] | None = None,
) -> RouterVersion:
    """Log ``router_dir`` as a generating pyfunc model in ``run_id`` and register it as a new version of ``model_name``.

    ``model_config`` (see ``citer/routing/pyfunc.py``) defaults to the tags' slm, llm and tau; model refs in it should
    be hub ids or project-relative paths, never absolute paths inside the project. ``quantiles`` (the router's dev
    score quantiles) are logged as the file ``dev_score_quantiles.json`` beside it, their sha256 in a tag.
    """
    import tempfile

    import mlflow

    router_dir = Path(router_dir)
    for f in ("router.safetensors", "router.json"):
        if not (router_dir / f).is_file():
            raise RegistryError(f"{router_dir}: missing {f}; train the router first (dvc stage router_*)")
    client = _client(tracking_uri)
    # The pair the router was trained with travels in the tags, so every loader can refuse another pair
    # (citer.routing.pair_check); tags given by the caller win.
    tags = {**recorded_pair_of(router_dir), **tags, DIGEST_TAG: router_digests(router_dir)}
    artifacts = {"router_dir": str(router_dir)}
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run_id), warnings.catch_warnings():
        if quantiles is not None:
            artifacts[QUANTILES] = str(Path(tmp) / f"{QUANTILES}.json")
            write_json(artifacts[QUANTILES], [float(q) for q in quantiles])
            tags[QUANTILES_TAG] = file_digest(artifacts[QUANTILES])
        str_tags = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in tags.items()}
        # An input example would make MLflow load the SLM and LLM to validate it; the signature says the schema.
        warnings.filterwarnings("ignore", message=".*(input example|input_example|type hints).*")
        info = mlflow.pyfunc.log_model(
            name="router",
            python_model=str(PYFUNC_CODE),
            artifacts=artifacts,
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


NO_SWEEP_YET = "no sweep has promoted a router yet (run `citer eval sweep`)"


class NoChampion(RegistryError):
    """No router holds the alias: an outcome a pipeline reports, not a fault; ``reason`` says why."""

    def __init__(self, message: str, reason: str = NO_SWEEP_YET):
        super().__init__(message)
        self.reason = reason


def require_champion(
    model_name: str, alias: str, tracking_uri: str | None = None, root: Path | None = None
) -> RouterVersion:
    """The champion, or :class:`NoChampion` telling which stage to run; also checks that its models still exist.

    Relative model paths in its tags resolve against ``root`` (the project root; default the current directory).
    """
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        raise NoChampion(
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


@dataclass(frozen=True)
class VersionFiles:
    router_dir: Path  # the router's files, as registered
    quantiles: list[float] | None  # its dev score quantiles; None: registered without them


@contextlib.contextmanager
def verified_files(rv: RouterVersion) -> Iterator[VersionFiles]:
    """A version's artifacts in a temporary directory, once they match the sha256 its tags recorded at registration
    (:func:`check_digests`): the router directory and the quantile table. Nothing is loaded, so a command that ends up
    decoding nothing (a finished output) still fails closed on a tampered champion."""
    import tempfile

    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow.artifacts.download_artifacts(f"models:/{rv.name}/{rv.version}", dst_path=tmp))
        arts = mlflow.models.Model.load(str(local)).flavors["python_function"]["artifacts"]
        router_dir = local / arts["router_dir"]["path"]
        check_digests(rv, router_dir)
        table, want = local / arts.get(QUANTILES, {}).get("path", ""), rv.tags.get(QUANTILES_TAG)
        if want and (not table.is_file() or file_digest(table) != want):
            raise RegistryError(
                f"router '{rv.name}' v{rv.version}: {QUANTILES}.json is missing or does not match the sha256 "
                "recorded at registration (tampered or corrupted); refusing to use it"
            )
        yield VersionFiles(router_dir, json.loads(table.read_text(encoding="utf-8")) if want else None)


def load_router_version(rv: RouterVersion, slm: Any = None):
    """A version's router from its ``router_dir`` artifact: an MLPRouter on the hidden state alone (no models loaded),
    or, for a router on more inputs, a FeatureRouter that shares ``slm``'s head and embedding (``slm`` required)."""
    from citer.routing.mlp import load_router

    with verified_files(rv) as files:
        router, _ = load_router(files.router_dir, slm=slm)
    return router


def check_digests(rv: RouterVersion, router_dir: Path) -> None:
    """Refuse router files whose sha256 differs from what the version recorded at registration (or records none)."""
    want = rv.tags.get(DIGEST_TAG)
    if not want:
        raise RegistryError(
            f"router '{rv.name}' v{rv.version}: no {DIGEST_TAG} tag (registered before digests were recorded); "
            "rerun the sweep to register a verifiable version"
        )
    got = router_digests(router_dir)
    for f, digest in json.loads(want).items():
        if got.get(f) != digest:
            raise RegistryError(
                f"router '{rv.name}' v{rv.version}: {f} in the artifact store does not match the sha256 recorded at "
                "registration (tampered or corrupted); refusing to load it"
            )


@dataclass(frozen=True)
class ChampionToCompare:
    """The version holding the alias and, when it routes for this SLM, its router to re-evaluate in the sweep."""

    version: RouterVersion | None  # None: no champion yet
    router: Any | None  # None: no champion, or one that cannot run on this SLM (``note`` says why)
    note: str
    # Trained for other weights under the pair's names (its digests differ, or it records none): no loader will
    # decode with it, so a candidate that passes every other gate may take its alias.
    stale: bool = False

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
    pair: dict[str, str] | None = None,
) -> ChampionToCompare:
    """The champion, re-usable in a sweep only when it was registered for the same SLM and hidden size.

    With ``root`` an SLM recorded relative to the project and the same directory named absolutely are the same.
    ``slm_model`` (the loaded SLM) lets a champion that reads more than the hidden state be rebuilt on it. With
    ``pair`` (:func:`~citer.routing.iterations.pair_digests` of the pair in use) a champion whose tags record other
    digests, or none, is ``stale``: not re-evaluated, and replaceable.
    """
    rv = get_alias(model_name, alias, tracking_uri)
    if rv is None:
        return ChampionToCompare(None, None, "no champion yet")
    if not _same_model(rv.tags.get("slm", ""), slm, root):
        return ChampionToCompare(
            rv, None, f"champion v{rv.version} routes for SLM {rv.tags.get('slm')}, not {slm}"
        )
    if pair is not None:
        from citer.routing.pair_check import pair_problem

        problem = pair_problem(rv.tags, pair, f"champion v{rv.version}")
        if problem is not None:
            return ChampionToCompare(rv, None, problem, stale=True)
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
    expected_champion: str | None | bool = False,
    quantiles: Sequence[float] | None = None,
) -> RouterVersion:
    """Register ``router_dir`` as a new version and, when ``promote``, move ``alias`` to it.

    ``expected_champion`` (the version the sweep compared against, None for none): the alias moves only if it still
    points there (:func:`move_alias`, raising :class:`AliasMoved` after registering). False: no check.
    """
    rv = register_router(
        router_dir,
        model_name=model_name,
        run_id=run_id,
        tags=tags,
        tracking_uri=tracking_uri,
        model_config=model_config,
        quantiles=quantiles,
    )
    if promote and expected_champion is False:
        set_alias(model_name, alias, rv.version, tracking_uri)
    elif promote:
        move_alias(model_name, alias, rv.version, expected_champion or None, tracking_uri)
    return rv
