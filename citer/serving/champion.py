"""The deployed decoder: the champion :func:`citer.tracking.deployed.open_champion` resolved (the router holding the
registry alias, with the SLM, LLM and τ its version names) as an engine. Batch inference, serving and the Python API
(:func:`citer.load_champion`) all build it here, so they decode with exactly what the sweep promoted."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from citer.config.serving import EngineParams
from citer.decoding.engine import RoutedEngine, engine_from_block
from citer.models.loading import load_pair
from citer.project import Project, as_project
from citer.tracking.deployed import ChampionError, Deployment, open_champion


class Champion(NamedTuple):
    """The champion as a ready decoder: ``engine.generate(tokenizer.encode(prompt), ...)``."""

    engine: RoutedEngine
    tokenizer: Any
    info: dict[str, Any]  # router name/version, alias, slm, llm, tau


def load_champion(
    project: Project | str | os.PathLike[str] = ".",
    tau: float | None = None,
    llm_fraction: float | None = None,
    allow_pair_mismatch: bool = False,
) -> Champion:
    """The router holding the project's registry alias, with its SLM and LLM, as a :class:`Champion`.

    ``project`` is a :class:`~citer.project.Project` or a project directory (its ``params.yaml`` is read). The
    version's tags name its SLM, LLM and τ; ``tau`` or ``llm_fraction`` (else ``serve.tau`` / ``serve.llm_fraction``
    in params) overrides τ (:func:`~citer.tracking.deployed.open_champion`). Relative model paths are resolved
    against the project root. Raises :class:`~citer.tracking.store.RegistryError` when there is no champion,
    :class:`~citer.tracking.deployed.ChampionError` when its router does not fit its SLM or params name another
    pair, and :class:`~citer.routing.pair_check.PairMismatch` when it was trained for other model files under those
    names (``allow_pair_mismatch``: a warning instead).
    """
    proj = as_project(project)
    with open_champion(proj, tau, llm_fraction, allow_pair_mismatch=allow_pair_mismatch) as deployment:
        return build_champion(proj, deployment)


def route_engine(
    slm: Any,
    llm: Any,
    router: Any,
    tau: float,
    engine: EngineParams,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    vocab_size: int | None = None,
    **verify: Any,
) -> Any:
    """The routed engine as ``citer route`` and ``citer serve`` run it: the params' ``engine:`` block on the pair
    (``runner: llama_cpp``: both models as GGUF files of ``llama_cpp_type`` on llama.cpp, a
    :class:`~citer.decoding.llama_cpp_engine.LlamaCppEngine`); ``bench/roofline.py`` builds its engines here too, so
    what it measures is what they run."""
    if engine.runner == "llama_cpp":
        from citer.decoding.llama_cpp_engine import LlamaCppEngine
        from citer.models.to_gguf import gguf_for

        t = engine.llama_cpp_type
        return LlamaCppEngine(
            gguf_for(slm, t), gguf_for(llm, t), router, tau, eos_token_id, vocab_size,
            llm_min_rows=engine.llm_min_rows, llm_max_wait_steps=engine.llm_max_wait_steps,
            llm_schedule=engine.llm_schedule, llm_prefill=engine.llm_prefill, **verify,
        )  # fmt: skip
    return engine_from_block(
        slm, llm, router, tau, engine.model_dump(), eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        vocab_size=vocab_size, **verify,
    )  # fmt: skip


def build_champion(proj: Project, deployment: Deployment) -> Champion:
    """The engine of a champion :func:`~citer.tracking.deployed.open_champion` resolved: its pair, router and τ."""
    from citer.routing.mlp import load_router

    params, rv, tau = proj.params, deployment.version, deployment.tau
    paths = {role: proj.model_ref(rv.tags[role]) for role in ("slm", "llm")}
    m = params.models
    slm, llm, tok = load_pair(
        paths["slm"], paths["llm"], m.dtype, m.device, m.trust_remote_code, llm_device_map=m.llm_device_map
    )
    router, _ = load_router(deployment.files.router_dir, slm=slm)
    if router.hidden_size != slm.config.hidden_size:
        raise ChampionError(
            f"router '{rv.name}' v{rv.version}: hidden_size={router.hidden_size} but SLM {paths['slm']} has "
            f"hidden size {slm.config.hidden_size}"
        )
    router = router.to(slm.device).eval()
    chosen_on, runs_on = rv.tags.get("runner", "torch"), params.engine.runner_name()
    if chosen_on != runs_on:
        raise ChampionError(
            f"router '{rv.name}' v{rv.version}: its τ was chosen on runner {chosen_on}, params.yaml's engine decodes "
            f"with {runs_on}; run the sweep with this engine block (citer eval sweep) or set it back"
        )
    engine = route_engine(
        slm, llm, router, tau, params.engine, tok.eos_token_id, tok.pad_token_id, **rv.verify_kwargs
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
