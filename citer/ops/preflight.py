"""What a run needs from the machine and the disk, checked before its first stage does any work.

Params are checked on load (types, ranges, keys); what they point at is checked here: the devices (``models.device``
and ``models.llm_device_map`` on a machine that has them), the dtypes those devices can run, the model directories
a disabled bootstrap relies on, and the data files a disabled synth relies on. Without it a run on a machine with no
CUDA spent minutes on synth, validate and bootstrap before failing at model load. Every problem found is named in
one line (:class:`PreflightError`), each by its params key and path.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from citer.config import DEVICE_STRATEGIES
from citer.ops.exp_copy import link_workspace_inputs, workspace_of
from citer.project import Project


class PreflightError(ValueError):
    """The machine or the disk cannot run these params; the message names every key that fails."""


def _device_problem(key: str, device: Any) -> str | None:
    """Why ``device`` (a torch device string or GPU index) is not on this machine, or None."""
    if device in DEVICE_STRATEGIES or device in ("disk", "cpu"):
        return None  # placed by accelerate over whatever is there; every machine has a CPU (no torch import)
    import torch

    d = torch.device(f"cuda:{device}" if isinstance(device, int) else str(device))
    if d.type == "cuda":
        count = torch.cuda.device_count()
        if (d.index or 0) >= count:
            return f"{key}: {device!r} is not on this machine (torch sees {count} CUDA device(s))"
    if d.type == "mps" and not torch.backends.mps.is_available():
        return f"{key}: {device!r} is not on this machine (no MPS backend)"
    return None


def _bf16_problem(key: str, device: str) -> str | None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.device_count() and not torch.cuda.is_bf16_supported():
        return f"{key}: bfloat16 on {device!r}, whose GPU has no bfloat16 support (use float16 or float32)"
    return None


def device_problems(proj: Project) -> list[str]:
    p = proj.params
    m = p.models
    out = [_device_problem("models.device", m.device)]
    if isinstance(m.llm_device_map, dict):
        out += [_device_problem(f"models.llm_device_map.{k}", v) for k, v in m.llm_device_map.items()]
    if out[0] is None:  # dtypes on a device that exists
        if m.dtype == "bfloat16":
            out.append(_bf16_problem("models.dtype", m.device))
        if p.finetune.enabled and p.finetune.bf16:
            out.append(_bf16_problem("finetune.bf16", m.device))
    return [x for x in out if x]


def _local(proj: Project, ref: str) -> bool:
    """A model ref meant as a directory, not a hub id (``org/name``): absolute, ``./``, deeper than two parts, or
    under a directory of the project (``models/mine`` with ``models/``)."""
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        return True
    if not ref:
        return False
    # an experiment's copy may lack the directory itself (git-ignored): the workspace it was made from decides
    roots = [proj.root, workspace_of(proj.root)]
    return any(r is not None and (r / Path(ref).parts[0]).is_dir() for r in roots)


def user_inputs(proj: Project) -> list[tuple[str, str, str]]:
    """The model directories and data files that params rely on and that no stage of this run will write, each as
    (params key, ref, "dir" or "file")."""
    p = proj.params
    out = []
    if not p.bootstrap.enabled:
        refs = [(k, getattr(p.models, k)) for k in ("slm", "llm")]
        out += [(f"models.{k}", ref, "dir") for k, ref in refs if _local(proj, ref)]
    if not p.synth.enabled:
        out += [(f"data.{k}", getattr(p.data, k), "file") for k in ("train", "dev", "test")]
        out += [(f"validate.files[{i}]", ref, "file") for i, (ref, _fmt) in enumerate(p.validate_.files)]
    if p.inference.input is not None:
        out.append(("inference.input", p.inference.input, "file"))
    if p.finetune.enabled and p.finetune.deepspeed:
        out.append(("finetune.deepspeed_config", p.finetune.deepspeed_config, "file"))
    return out


def path_problems(proj: Project) -> list[str]:
    """Each of :func:`user_inputs` that is not there, named by its key and path."""
    out = []
    for key, ref, kind in user_inputs(proj):
        where = proj.path(ref)
        if kind == "dir" and not where.is_dir():
            out.append(f"bootstrap.enabled is false but {key}={ref} is not a directory ({where})")
        elif kind == "file" and not where.is_file():
            why = "synth.enabled is false but " if key.startswith("data.") else ""
            out.append(f"{why}{key}={ref} does not exist ({where})")
    return out


def preflight(proj: Project, params_file: str | Path = "params.yaml") -> None:
    """Raise :class:`PreflightError` naming every device, dtype, model directory and data file problem."""
    for ref in link_workspace_inputs(proj.root, [ref for _key, ref, _kind in user_inputs(proj)]):
        print(
            f"linked {ref} from the workspace into this experiment's copy (git and DVC's cache do not hold it)",
            file=sys.stderr,
        )
    problems = device_problems(proj) + path_problems(proj)
    if problems:
        raise PreflightError("; ".join(problems) + f" ({params_file}: checked before any stage ran)")
