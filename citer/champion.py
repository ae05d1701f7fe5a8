"""The deployed decoder: the router holding the registry alias, with the SLM, LLM and τ its version names.

Batch inference and serving both start from here, so they decode with exactly what the sweep promoted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from citer.registry import RegistryError


class ChampionError(RegistryError):
    """The champion cannot be used as registered (a tag missing, a router that does not fit its SLM)."""


def build_engine_from_champion(
    params: Any, root: str | Path = ".", tracking_uri: str | None = None, tau: float | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """``(engine, tokenizer, info)`` for the router holding the registry alias (``params.registry``).

    The router version's tags name its SLM, LLM and τ (``tau``, else ``params.serve.tau``, overrides it); relative
    model paths are
    resolved against ``root``. Raises :class:`citer.registry.RegistryError` when there is no champion and
    :class:`ChampionError` when its router does not fit its SLM.
    """
    from citer.engine import RoutedEngine
    from citer.models import load_pair
    from citer.registry import load_router_version, require_champion

    reg = params.registry
    rv = require_champion(reg.model_name, reg.alias, tracking_uri)
    paths = {}
    for role in ("slm", "llm"):
        name = rv.tags.get(role)
        if not name:
            raise ChampionError(f"router '{rv.name}' v{rv.version} (@{reg.alias}): tag {role} missing")
        local = Path(root) / name
        paths[role] = str(local) if not Path(name).is_absolute() and local.exists() else name
    if tau is None:
        tau = params.serve.tau if params.serve.tau is not None else rv.tau
    slm, llm, tok = load_pair(paths["slm"], paths["llm"], params.models.dtype, params.models.device)
    router = load_router_version(rv)
    if router.hidden_size != slm.config.hidden_size:
        raise ChampionError(
            f"router '{rv.name}' v{rv.version}: hidden_size={router.hidden_size} but SLM {paths['slm']} has "
            f"hidden size {slm.config.hidden_size}"
        )
    router = router.to(slm.device).eval()
    engine = RoutedEngine(
        slm, llm, router, tau=tau, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    info = {
        "router": f"{rv.name}/{rv.version}",
        "alias": reg.alias,
        "slm": paths["slm"],
        "llm": paths["llm"],
        "tau": tau,
        "version": rv.version,
    }
    return engine, tok, info
