"""How many torch threads a stage uses: one for small models, else the cores free when the stage starts.

Torch starts one OpenMP thread per core, and OpenMP threads spin while they wait for work. The embedded pair's
models are tiny (the LLM's weights are 1.5 MB): their steps are short ops dominated by per-call overhead, so a second
thread gains nothing on a quiet machine, and with another process busy on one of two cores the two threads spin
against it (measured before this module: ``iterate`` 5x its quiet time, ``dvc repro`` 1,206 s against 443-495 s).
So a stage whose largest model has under :data:`SMALL_WEIGHT_BYTES` of weights runs on one thread, and a larger
one on the cores that are free when it starts (sampled, at least one), never more than the process may use. How the
threads of a multi-threaded stage wait between parallel regions is :mod:`citer.ops.openmp`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from citer.project import Project

SMALL_WEIGHT_BYTES = 64 << 20  # below this the largest model's steps are overhead-bound: one thread
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_cores(sample_s: float = 0.25) -> float:
    """The idle share of the usable cores over ``sample_s`` seconds, in cores (2 cores, one busy elsewhere: ~1)."""
    import psutil

    per_cpu = psutil.cpu_percent(interval=sample_s, percpu=True)
    try:
        mine = sorted(os.sched_getaffinity(0))
        per_cpu = [per_cpu[i] for i in mine if i < len(per_cpu)] or per_cpu
    except AttributeError:
        pass
    return sum(max(0.0, 100.0 - p) for p in per_cpu) / 100.0


def weight_bytes(model_dir: str | os.PathLike[str]) -> int:
    """Bytes of a local model directory's weight files (0 for a hub id or a directory not written yet)."""
    d = Path(model_dir)
    if not d.is_dir():
        return 0
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES)


def arch_bytes(vocab_size: int, hidden: int, inter: int, layers: int, bytes_per_param: int = 4) -> int:
    """About what a Qwen2-style model of this shape weighs (embedding + head + attention + MLP per layer)."""
    return bytes_per_param * (2 * vocab_size * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter))


def choose_threads(largest_weight_bytes: int, free: float, usable: int) -> int:
    """One thread for small models, else the free cores (rounded, at least one, at most ``usable``)."""
    if largest_weight_bytes < SMALL_WEIGHT_BYTES:
        return 1
    return max(1, min(usable, math.floor(free + 0.5)))


def stage_threads(weights: Iterable[int], fixed: int = 0) -> int:
    """The torch threads for a stage whose models weigh ``weights`` bytes; ``fixed`` > 0 overrides the choice."""
    if fixed > 0:
        return fixed
    largest = max(weights, default=0)
    if largest < SMALL_WEIGHT_BYTES:
        return 1  # no need to sample the machine
    return choose_threads(largest, free_cores(), usable_cores())


def job_processes(requested: int, n_jobs: int, stage_threads: int) -> int:
    """Worker processes for ``n_jobs`` independent jobs of a stage (:func:`citer.ops.processes.run_jobs`):
    ``requested`` (``runtime.workers``), at most one per job and per usable core; 0 (run them in the stage's process,
    in order) when that is one, or when the stage runs more than one torch thread: its models are large, the cores
    are in use already and every worker would hold its own copy of them."""
    n = min(requested, n_jobs, usable_cores())
    return n if n > 1 and stage_threads <= 1 else 0


def stage_weights(proj: Project) -> list[int]:
    """Bytes of weights of the models a stage of ``proj`` runs: the local directories as they are, the embedded
    pair's shapes when bootstrap will write it, and "large" for a model that is neither (a hub id)."""
    p = proj.params
    out = []
    for ref in (p.models.slm, p.models.llm):
        if proj.path(ref).is_dir():
            out.append(weight_bytes(proj.path(ref)))
        elif not p.bootstrap.enabled:
            out.append(1 << 62)  # not on disk: its size is unknown, so assume it needs the cores
    if p.bootstrap.enabled:
        b = p.bootstrap
        out += [
            arch_bytes(b.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers)
            for a in (b.slm, b.llm)
        ]
    return out


def set_stage_threads(proj: Project) -> int:
    """Torch threads for the stage about to run (:mod:`citer.ops.threads`, ``runtime.stage_threads``)."""
    import torch

    n = stage_threads(stage_weights(proj), proj.params.runtime.stage_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
