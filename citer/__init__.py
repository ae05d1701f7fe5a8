"""citer: token-level routed decoding between a small and a large language model (CITER), as an MLOps pipeline.

The public API is the handful of names below; everything else is reached through its subpackage
(``citer.data``, ``citer.models``, ``citer.decoding``, ``citer.routing``, ``citer.evaluation``, ``citer.serving``).
Names are imported on first use, so ``import citer`` does not load torch or transformers.

    import citer

    champ = citer.load_champion(".")  # the project's promoted router with its SLM, LLM and tau
    ids = champ.tokenizer.encode("Question: What is 2 + 3?\nAnswer:", add_special_tokens=False)
    out = champ.engine.generate(ids, max_new_tokens=64)
    print(champ.tokenizer.decode(out.tokens[0]), f"{out.batch.llm_fraction:.0%} of tokens by the LLM")
    # The routed policy's log-likelihood of a continuation (each token scored by the model the router picks there).
    cont = champ.tokenizer.encode(" The answer is 5.", add_special_tokens=False)
    print(citer.routed_loglikelihood(champ.engine, ids, cont).total)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    "load_pair": "citer.models.loading",
    "RoutedEngine": "citer.decoding.engine",
    "GenerationResult": "citer.decoding.engine",
    "routed_loglikelihood": "citer.decoding.scoring",
    "load_router": "citer.routing.mlp",
    "load_champion": "citer.serving.champion",
    "Champion": "citer.serving.champion",
    "load_project": "citer.project",
    "Project": "citer.project",
}

__all__ = [
    "Champion",
    "GenerationResult",
    "Project",
    "RoutedEngine",
    "__version__",
    "load_champion",
    "load_pair",
    "load_project",
    "load_router",
    "routed_loglikelihood",
]

if TYPE_CHECKING:
    from citer.decoding.engine import GenerationResult, RoutedEngine
    from citer.decoding.scoring import routed_loglikelihood
    from citer.models.loading import load_pair
    from citer.project import Project, load_project
    from citer.routing.mlp import load_router
    from citer.serving.champion import Champion, load_champion


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'citer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
