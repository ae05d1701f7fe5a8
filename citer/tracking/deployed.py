"""The champion a command deploys, resolved once (:func:`open_champion`, where ``citer route``, ``citer serve`` and
:func:`citer.load_champion` start): the version holding the project's alias, its pair checked against params, its
files verified against the sha256 its tags record, and τ: given, from a target LLM fraction through the version's
quantile table (a file logged with it), or the version's own (chosen on dev)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from citer.project import Project, as_project
from citer.tracking.registry import NO_SWEEP_YET, NoChampion, VersionFiles, require_champion, verified_files
from citer.tracking.store import RegistryError, RouterVersion, open_store


class ChampionError(RegistryError):
    """The champion cannot be used as registered (a tag missing, a router that does not fit its SLM)."""


@dataclass(frozen=True)
class Deployment:
    """The champion version, the τ a command routes with, and its verified files (while the block runs)."""

    version: RouterVersion
    tau: float
    files: VersionFiles


def project_champion(
    project: Project | str | os.PathLike[str] = ".", allow_pair_mismatch: bool = False
) -> RouterVersion:
    """The version holding the project's alias, once its pair is checked against params.

    Opens the project's own store (:func:`~citer.tracking.store.open_store`: rebased when the project was copied or
    moved) and refuses, in one line naming both, a champion trained for another SLM or LLM than params name: routing
    its scores with other models would silently decode with a router that never saw them. The names are not enough
    (a re-finetuned SLM keeps its directory): the digests the version's tags record must be those of the model files
    in use (:mod:`citer.routing.pair_check`); ``allow_pair_mismatch`` turns that refusal into a warning.
    """
    proj = as_project(project)
    reg = proj.params.registry
    try:
        rv = require_champion(reg.model_name, reg.alias, open_store(proj), proj.root)
    except NoChampion as exc:
        if (refused := refused_promotion(proj)) is None:
            raise
        raise NoChampion(
            f"no router holds the alias '{reg.alias}' of registered model '{reg.model_name}': the last sweep ran "
            f"and promoted nothing: {refused}",
            refused,
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
        warn=lambda message: print(f"warning: {message}", file=sys.stderr),
    )
    return rv


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
    from citer.tracking.alias import get_alias

    reg = proj.params.registry
    if get_alias(reg.model_name, reg.alias, open_store(proj)) is not None:
        return None
    return refused_promotion(proj) or NO_SWEEP_YET


def champion_tau(
    rv: RouterVersion,
    quantiles: list[float] | None,
    tau: float | None = None,
    llm_fraction: float | None = None,
) -> float:
    """τ to route with: ``tau``, else the τ that sends ``llm_fraction`` of tokens to the LLM (the version's dev score
    ``quantiles``, recorded by the sweep), else the version's own τ (chosen on dev)."""
    if tau is not None and llm_fraction is not None:
        raise ChampionError("give tau or llm_fraction, not both")
    if tau is not None:
        return float(tau)
    if llm_fraction is not None:
        from citer.evaluation.thresholds import tau_for_fraction

        if not quantiles:
            raise ChampionError(
                f"router '{rv.name}' v{rv.version} has no dev score quantiles (registered without them); rerun "
                "`citer eval sweep` or pass a tau"
            )
        return tau_for_fraction(quantiles, float(llm_fraction))
    return rv.tau


@contextlib.contextmanager
def open_champion(
    project: Project | str | os.PathLike[str] = ".",
    tau: float | None = None,
    llm_fraction: float | None = None,
    *,
    settings: Any = None,
    allow_pair_mismatch: bool = False,
) -> Iterator[Deployment]:
    """The project's champion (:func:`project_champion`) with its files verified and τ resolved (:func:`champion_tau`);
    the files live until the block ends. ``tau`` or ``llm_fraction`` given by the command win; else those of
    ``settings``, the params block of the command (``serve``, the default, or ``inference``)."""
    proj = as_project(project)
    rv = project_champion(proj, allow_pair_mismatch)
    if tau is None and llm_fraction is None:
        s = settings or proj.params.serve
        tau, llm_fraction = s.tau, s.llm_fraction
    with verified_files(rv) as files:
        yield Deployment(rv, champion_tau(rv, files.quantiles, tau, llm_fraction), files)
