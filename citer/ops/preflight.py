"""What a run needs from the machine and the disk, checked before its first stage does any work.

Params are checked on load (types, ranges, keys); what they point at is checked here: the devices (``models.device``
and ``models.llm_device_map`` on a machine that has them), the dtypes those devices can run, the model directories
a disabled bootstrap relies on, and the data files a disabled synth relies on. Without it a run on a machine with no
CUDA spent minutes on synth, validate and bootstrap before failing at model load. Every problem found is named in
one line (:class:`PreflightError`), each by its params key and path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from citer.config import DEVICE_STRATEGIES
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
    return (proj.root / Path(ref).parts[0]).is_dir() if ref else False


def path_problems(proj: Project) -> list[str]:
    """Model directories and data files that params rely on and that no stage of this run will write."""
    p = proj.params
    out = []
    if not p.bootstrap.enabled:
        for key in ("slm", "llm"):
            ref = getattr(p.models, key)
            if _local(proj, ref) and not proj.path(ref).is_dir():
                out.append(
                    f"bootstrap.enabled is false but models.{key}={ref} is not a directory ({proj.path(ref)})"
                )
    if not p.synth.enabled:
        for key in ("train", "dev", "test"):
            ref = getattr(p.data, key)
            if not proj.path(ref).is_file():
                out.append(f"synth.enabled is false but data.{key}={ref} does not exist ({proj.path(ref)})")
        for i, (ref, _fmt) in enumerate(p.validate_.files):
            if not proj.path(ref).is_file():
                out.append(f"validate.files[{i}]={ref} does not exist")
    if p.inference.input is not None and not proj.path(p.inference.input).is_file():
        out.append(f"inference.input={p.inference.input} does not exist ({proj.path(p.inference.input)})")
    if p.finetune.enabled and p.finetune.deepspeed and not proj.path(p.finetune.deepspeed_config).is_file():
        out.append(f"finetune.deepspeed_config={p.finetune.deepspeed_config} does not exist")
    return out


def preflight(proj: Project, params_file: str | Path = "params.yaml") -> None:
    """Raise :class:`PreflightError` naming every device, dtype, model directory and data file problem."""
    problems = device_problems(proj) + path_problems(proj)
    if problems:
        raise PreflightError("; ".join(problems) + f" ({params_file}: checked before any stage ran)")
