"""A router decodes only for the pair it was trained with: the digests it recorded against the pair in use.

A router reads one SLM's hidden states and learned where that SLM and one LLM disagree, so the same directory names
with other weights (a re-finetuned SLM) make it route blindly: accuracy falls and the LLM's share of tokens rises,
with no error anywhere. Every router records ``slm_digest``/``llm_digest`` (:func:`citer.routing.iterations.
pair_digests`) in its ``router.json``, the registry copies them into the version's tags, and every loader (the
sweep, ``route``, ``serve``, the MLflow model, :func:`citer.load_champion`) compares them with the pair it decodes
with, here, refusing a mismatch in one line naming both digests. ``allow`` lets a deliberate mismatch through
with a warning (``--allow-pair-mismatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from citer.routing.iterations import ProvenanceError

DIGEST_KEYS = ("slm_digest", "llm_digest")


class PairMismatch(ProvenanceError):
    """A router (or registered version) trained for another SLM or LLM than the pair in use."""


def short(digest: str | None) -> str:
    """A digest as messages show it: 12 hex digits (a hub id as is)."""
    if not digest:
        return "none"
    return digest if digest.startswith("hub:") else digest[:12]


def recorded_pair(meta: Mapping[str, Any]) -> dict[str, str]:
    """The ``slm_digest``/``llm_digest`` a router's meta or a version's tags record (missing ones left out)."""
    return {k: str(meta[k]) for k in DIGEST_KEYS if meta.get(k)}


def pair_problem(recorded: Mapping[str, Any], current: Mapping[str, str], what: str) -> str | None:
    """One line saying how ``recorded`` (a router's meta or a version's tags) differs from ``current`` (the pair's
    :func:`~citer.routing.iterations.pair_digests`), or None when both digests match."""
    rec = recorded_pair(recorded)
    if len(rec) < len(DIGEST_KEYS):
        return (
            f"{what} records no pair digests (trained or registered before they were recorded), so its SLM and LLM "
            f"cannot be checked against the pair in use (SLM {short(current['slm_digest'])}, LLM "
            f"{short(current['llm_digest'])})"
        )
    differ = [k.removesuffix("_digest").upper() for k in DIGEST_KEYS if rec[k] != current[k]]
    if not differ:
        return None
    return (
        f"{what} was trained for SLM {short(rec['slm_digest'])}, LLM {short(rec['llm_digest'])}; the pair in use "
        f"is SLM {short(current['slm_digest'])}, LLM {short(current['llm_digest'])} ({' and '.join(differ)} "
        "changed)"
    )


def check_pair(
    recorded: Mapping[str, Any],
    current: Mapping[str, str],
    what: str,
    *,
    remedy: str,
    allow: bool = False,
    warn: Callable[[str], Any] | None = None,
) -> None:
    """Refuse (:class:`PairMismatch`) a router whose recorded digests are not the pair in use; with ``allow`` only
    ``warn`` (default: a Python warning) and go on."""
    problem = pair_problem(recorded, current, what)
    if problem is None:
        return
    if not allow:
        raise PairMismatch(f"{problem}; {remedy}")
    message = f"{problem}; used anyway (--allow-pair-mismatch)"
    if warn is not None:
        warn(message)
    else:
        import warnings

        warnings.warn(message, stacklevel=2)
