"""How torch's OpenMP threads wait between parallel regions: spin briefly, then sleep (:data:`WAIT_ENV`).

A decode step on a CPU is a long chain of short parallel regions (each linear, the attention, the norms), back to back.
A thread that sleeps between them (``OMP_WAIT_POLICY=PASSIVE``) pays a wake-up at every region, which a real-size
model's step feels; one that spins for libgomp's default (about 3 ms) keeps a core busy after the work is done, which
on a shared machine takes it from another process. A spin count of 10,000 keeps the threads awake between a step's
regions and asleep between steps that are further apart (an idle server, a stage's Python work). Stages that run
their models on one thread (:mod:`citer.ops.threads`) have no waiting threads at all.

libgomp reads the environment once, when torch loads it: the ``citer`` console and the speed benches call
:func:`set_wait_env` before importing torch, so what a bench times is what ``citer route`` runs. A policy the
environment already names is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WAIT_ENV = {"GOMP_SPINCOUNT": "10000"}
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


_ADDED: dict[str, str] = {}  # what set_wait_env added to this process's environment


def set_wait_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :data:`WAIT_ENV` unless ``environ`` already names a wait policy; returns the policy in force.

    Once torch is imported into this process libgomp has read the environment already: then nothing is changed, and
    what is returned is what libgomp read."""
    loaded = environ is os.environ and "torch" in sys.modules
    if not loaded and not any(k in environ for k in WAIT_KEYS):
        environ.update(WAIT_ENV)
        if environ is os.environ:
            _ADDED.update(WAIT_ENV)
    return wait_env(environ)


def wait_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The wait-policy variables ``environ`` sets (what a report records)."""
    return {k: environ[k] for k in WAIT_KEYS if k in environ}


def peer_environ() -> dict[str, str]:
    """This process's environment without the policy :func:`set_wait_env` added: another program a bench races (a
    peer) runs with its own defaults, as its users run it."""
    return {k: v for k, v in os.environ.items() if k not in _ADDED}
