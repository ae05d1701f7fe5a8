"""The deployed decoder: the router holding the registry alias, with the SLM, LLM and τ its version names.

Batch inference, serving and the Python API (:func:`citer.load_champion`) all start from here, so they decode with
exactly what the sweep promoted.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from citer.decoding.engine import RoutedEngine
from citer.models.loading import load_pair
from citer.project import Project, as_project
from citer.tracking.registry import (
    RegistryError,
    RouterVersion,
    load_router_version,
    open_store,
    require_champion,
)


class ChampionError(RegistryError):
    """The champion cannot be used as registered (a tag missing, a router that does not fit its SLM)."""


class Champion(NamedTuple):
    """The champion as a ready decoder: ``engine.generate(tokenizer.encode(prompt), ...)``."""

    engine: RoutedEngine
    tokenizer: Any
    info: dict[str, Any]  # router name/version, alias, slm, llm, tau


def project_champion(
    project: Project | str | os.PathLike[str] = ".", allow_pair_mismatch: bool = False
) -> RouterVersion:
    """The version holding the project's alias, once its pair is checked against params.

    Opens the project's own store (rebased when the project was copied or moved, :func:`citer.tracking.registry.open_store`)
    and refuses, in one line naming both, a champion trained for another SLM or LLM than params name: routing its
    scores with other models would silently decode with a router that never saw them. The names are not enough (a
    re-finetuned SLM keeps its directory): the digests the version's tags record must be those of the model files
    in use (:mod:`citer.routing.pair_check`); ``allow_pair_mismatch`` turns that refusal into a warning.
    """
    proj = as_project(project)
    reg = proj.params.registry
    try:
        rv = require_champion(reg.model_name, reg.alias, open_store(proj), proj.root)
    except RegistryError as exc:
        refused = refused_promotion(proj)
        if refused is None:
            raise
        raise RegistryError(
            f"no router holds the alias '{reg.alias}' of registered model '{reg.model_name}': the last sweep ran "
            f"and promoted nothing: {refused}"
        ) from exc
    for role in ("slm", "llm"):
        if not rv.tags.get(role):
            raise ChampionError(f"router '{rv.name}' v{rv.version} (@{reg.alias}): tag {role} missing")
    champ = {"slm": rv.tags["slm"], "llm": rv.tags["llm"]}
    named = {"slm": proj.portable_ref(proj.slm_name), "llm": proj.portable_ref(proj.params.models.llm)}
    if not all(proj.same_ref(champ[r], named[r]) for r in ("slm", "llm")):
        slm_key = "models.finetuned_slm" if proj.params.finetune.enabled else "models.slm"
        raise ChampionError(
            f"champion {rv.name} v{rv.version} was trained for slm={champ['slm']}, llm={champ['llm']}; params name "
            f"slm={named['slm']} ({slm_key}), llm={named['llm']} (models.llm); rerun the sweep or point params at "
            "the champion's pair"
        )
    from citer.routing.iterations import pair_digests
    from citer.routing.pair_check import check_pair

    check_pair(
        rv.tags,
        pair_digests(proj.slm_ref, proj.llm_ref),
        f"champion {rv.name} v{rv.version}",
        remedy="rerun the pipeline for this pair (`citer router iterate`, then `citer eval sweep`), or pass "
        "--allow-pair-mismatch to use it anyway",
        allow=allow_pair_mismatch,
        warn=_warn,
    )
    return rv


def _warn(message: str) -> None:
    import sys

    print(f"warning: {message}", file=sys.stderr)


def refused_promotion(proj: Project) -> str | None:
    """The gate that held, when the project's last sweep ran and promoted no router (``reports/promotion.json``)."""

    path = proj.reports / "promotion.json"
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if rec.get("promoted") or not rec.get("reason"):
        return None
    return f"{rec['reason']} ({proj.portable_ref(path)})"


def no_champion_reason(proj: Project) -> str | None:
    """Why no router holds the project's alias (the last sweep's refusal, else that none ran); None when one does."""
    from citer.tracking.registry import get_alias

    reg = proj.params.registry
    if get_alias(reg.model_name, reg.alias, open_store(proj)) is not None:
        return None
    return refused_promotion(proj) or "no sweep has promoted a router yet (run `citer eval sweep`)"


def champion_tau(rv: Any, tau: float | None = None, llm_fraction: float | None = None) -> float:
    """τ to route with: ``tau``, else the τ that sends ``llm_fraction`` of tokens to the LLM (the version's dev score
    quantiles, recorded by the sweep), else the version's own τ (chosen on dev)."""
    if tau is not None and llm_fraction is not None:
        raise ChampionError("give tau or llm_fraction, not both")
    if tau is not None:
        return float(tau)
    if llm_fraction is not None:
        from citer.evaluation.thresholds import tau_for_fraction

        raw = rv.tags.get("dev_score_quantiles")
        if not raw:
            raise ChampionError(
                f"router '{rv.name}' v{rv.version} has no dev score quantiles (registered before llm_fraction "
                "existed); rerun `citer eval sweep` or pass a tau"
            )
        return tau_for_fraction(json.loads(raw), float(llm_fraction))
    return rv.tau


def load_champion(
    project: Project | str | os.PathLike[str] = ".",
    tau: float | None = None,
    llm_fraction: float | None = None,
    allow_pair_mismatch: bool = False,
) -> Champion:
    """The router holding the project's registry alias, with its SLM and LLM, as a :class:`Champion`.

    ``project`` is a :class:`~citer.project.Project` or a project directory (its ``params.yaml`` is read). The
    version's tags name its SLM, LLM and τ; ``tau`` or ``llm_fraction`` (else ``serve.tau`` / ``serve.llm_fraction``
    in params) overrides τ (:func:`champion_tau`). Relative model paths
    are resolved against the project root. Raises :class:`~citer.tracking.registry.RegistryError` when there is no champion
    and :class:`ChampionError` when its router does not fit its SLM or params name another pair, and
    :class:`~citer.routing.pair_check.PairMismatch` when it was trained for other model files under those names
    (``allow_pair_mismatch``: a warning instead; :func:`project_champion`).
    """
    proj = as_project(project)
    params = proj.params
    rv = project_champion(proj, allow_pair_mismatch)
    paths = {role: proj.model_ref(rv.tags[role]) for role in ("slm", "llm")}
    if tau is None and llm_fraction is None:
        tau, llm_fraction = params.serve.tau, params.serve.llm_fraction
    tau = champion_tau(rv, tau, llm_fraction)
    m = params.models
    slm, llm, tok = load_pair(
        paths["slm"], paths["llm"], m.dtype, m.device, m.trust_remote_code, llm_device_map=m.llm_device_map
    )
    router = load_router_version(rv, slm=slm)
    if router.hidden_size != slm.config.hidden_size:
        raise ChampionError(
            f"router '{rv.name}' v{rv.version}: hidden_size={router.hidden_size} but SLM {paths['slm']} has "
            f"hidden size {slm.config.hidden_size}"
        )
    router = router.to(slm.device).eval()
    engine = RoutedEngine(
        slm,
        llm,
        router,
        tau=tau,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        llm_min_rows=params.engine.llm_min_rows,
        llm_max_wait_steps=params.engine.llm_max_wait_steps,
        compile_forward=params.engine.compile_forward,
        overlap=params.engine.overlap,
        **rv.verify_kwargs,
    )
    info = {
        "router": f"{rv.name}/{rv.version}",
        "alias": params.registry.alias,
        "slm": paths["slm"],
        "llm": paths["llm"],
        "tau": tau,
        "version": rv.version,
        **rv.verify_kwargs,
    }
    return Champion(engine, tok, info)
