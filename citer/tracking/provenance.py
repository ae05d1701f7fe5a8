"""Where each report came from: ``reports/provenance.json`` names, per report file, the run that wrote it.

An entry records the file's sha256 (so a file edited or copied in afterwards no longer matches), the stage or bench
that wrote it, the git commit, a digest of the params it ran with, the machine (cores, torch, device) and the stage's
wall time. Stage flows stamp every report file they wrote when they finish (:func:`stamp_written`, called by
``flows.common.locked``); benches stamp their own report with their arguments in place of params. The docs quote only
files that carry an entry (``tests/test_docs_numbers.py``).

What a run measured or was handed that another run of the same code would not reproduce -- seconds, MLflow run ids
-- lives here too (:func:`record_run_facts`, under ``run_facts``), never in a stage's result files: two runs of the
same code and params write those byte for byte, so ``dvc.lock``'s output hashes move only when results do.

Light on purpose: no MLflow or Prefect, and torch only where the process loaded it, so ``bench/speed.py`` can use it
too.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from citer.ops.cpu import host_cpu
from citer.ops.io import file_digest, write_json

FILE = "provenance.json"


# The vector extensions that decide which of torch's float kernels run, and so the rounding of results: AVX2-only
# EPYCs, AVX-512 EPYCs with bf16 and AMX Xeons compute different bits from the same code. The identity records are
# compared by (a bench report lists more: bench/speed_report.DECODER_FLAGS).
ROUNDING_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def cpu_kind() -> str:
    """The CPU's model name and its kernel-deciding vector extensions (``/proc/cpuinfo``), e.g. ``AMD EPYC (avx2 fma
    avx512f avx512_vnni avx512_bf16)``: a result file reproduces bit for bit on the same kind."""
    cpu = host_cpu()
    return f"{cpu.model} ({' '.join(cpu.listed(ROUNDING_FLAGS)) or 'no vector extensions listed'})"


def machine() -> dict[str, Any]:
    """The machine a number was measured on: cores, the CPU kind, Python, torch and the accelerator (or ``cpu``).
    torch is asked only when the process already loaded it (a stage that never does, ``validate``, ran on the CPU; its
    version then comes from the package metadata, without the seconds of importing it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            torch_version = version("torch")
        except PackageNotFoundError:
            torch_version = "not installed"
        dev, threads = "cpu", None
    else:
        torch_version = torch.__version__
        dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        threads = torch.get_num_threads()
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_kind(),
        "python": platform.python_version(),
        "torch": torch_version,
        "device": dev,
        "torch_threads": threads,
    }


def params_digest(params: Any) -> str:
    """sha256 (first 16 hex digits) of the params as canonical JSON: a pydantic model, a mapping or a list."""
    data = params.model_dump(mode="json") if hasattr(params, "model_dump") else params
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _git(root: Path, *args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def git_head(
    root: str | os.PathLike[str], *, dirty: bool = False, outputs: Iterable[str] = ("reports", "dvc.lock")
) -> str:
    """The checked-out commit of ``root``, or ``unknown`` outside a git checkout. With ``dirty``, ``+dirty`` is
    appended when tracked files differ from it (the numbers may not be the commit's); ``outputs`` (paths relative to
    ``root``) are what runs rewrite, the reports themselves: they do not count."""
    head = _git(Path(root), "rev-parse", "HEAD") or "unknown"
    if not dirty or head == "unknown":
        return head
    spec = ["."] + [f":(exclude){o}" for o in outputs]
    dirty = bool(_git(Path(root), "status", "--porcelain", "--untracked-files=no", "--", *spec))
    return f"{head}+dirty" if dirty else head


def read(reports_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(reports_dir) / FILE
    if not path.is_file():
        return {"files": {}}
    data = json.loads(path.read_text(encoding="utf-8"))
    data.setdefault("files", {})
    return data


def stamp(
    reports_dir: str | os.PathLike[str],
    files: Iterable[str | os.PathLike[str]],
    *,
    stage: str,
    root: str | os.PathLike[str],
    wall_s: float,
    params: Any = None,
    args: Mapping[str, Any] | None = None,
) -> list[str]:
    """Record ``files`` (paths under ``reports_dir``) as written by ``stage``; returns their keys (paths relative
    to ``root``, so a copied project's record stays true). ``params`` (stages) or ``args`` (benches) say what ran."""
    reports, root = Path(reports_dir), Path(root)
    data = read(reports)
    rel = os.path.relpath(reports.resolve(), root.resolve())
    common = {
        "stage": stage,
        "commit": git_head(root, dirty=True, outputs=(rel, "dvc.lock")),
        "params_digest": None if params is None else params_digest(params),
        "machine": machine(),
        "stage_wall_s": round(float(wall_s), 2),
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if args is not None:
        common["args"] = {k: v for k, v in args.items()}
    keys = []
    for f in files:
        p = Path(f)
        if p.name == FILE or not p.is_file():
            continue
        key = os.path.relpath(p.resolve(), root.resolve())
        data["files"][key] = {"sha256": file_digest(p, "sha256"), **common}
        keys.append(key)
    if keys:
        data["files"] = dict(sorted(data["files"].items()))
        write_json(reports / FILE, data)
    return keys


def stamp_written(
    reports_dir: str | os.PathLike[str],
    since: float,
    *,
    stage: str,
    root: str | os.PathLike[str],
    wall_s: float,
    params: Any = None,
) -> list[str]:
    """Stamp every report file modified at or after ``since`` (a ``time.time()``) that no stage finishing inside
    this one stamped already (a pipeline stamps only what its own stages did not)."""
    reports, root = Path(reports_dir), Path(root)
    reports.mkdir(parents=True, exist_ok=True)
    known = read(reports)["files"]
    started = dt.datetime.fromtimestamp(since, dt.UTC).isoformat(timespec="seconds")
    fresh = []
    for p in sorted(reports.rglob("*")):
        if not p.is_file() or p.name == FILE or p.name.startswith(".") or p.stat().st_mtime < since:
            continue
        entry = known.get(os.path.relpath(p.resolve(), root.resolve()))
        if entry and entry["written_at"] >= started and entry["sha256"] == file_digest(p, "sha256"):
            continue
        fresh.append(p)
    keys = stamp(reports, fresh, stage=stage, root=root, wall_s=wall_s, params=params)
    record_run(reports, stage, root=root, started=since, wall_s=wall_s, params=params)
    return keys


def record_run(
    reports_dir: str | os.PathLike[str],
    stage: str,
    *,
    root: str | os.PathLike[str],
    started: float,
    wall_s: float,
    params: Any = None,
) -> None:
    """Keep the latest run of ``stage`` under ``runs`` (a stage that writes no report, e.g. the whole pipeline or
    the label/router iterations, still has its wall time on record)."""
    reports = Path(reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    data = read(reports)
    rel = os.path.relpath(reports.resolve(), Path(root).resolve())
    data.setdefault("runs", {})[stage] = {
        "started_at": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
        "wall_s": round(float(wall_s), 2),
        "commit": git_head(root, dirty=True, outputs=(rel, "dvc.lock")),
        "params_digest": None if params is None else params_digest(params),
        "machine": machine(),
    }
    write_json(reports / FILE, data)


# The keys of a stage's record that are wall-clock measurements (``seconds``, ``llm_pretrain_seconds``,
# ``sec_per_token``), not results; projected times (``gpu_sec_per_token``: bytes over bandwidth) are results.
MEASURED_KEY = re.compile(r"(^|_)seconds$|^sec_per_token$")


def split_measured(record: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(results, measured)``: ``record`` without its wall-clock keys (:data:`MEASURED_KEY`, at any depth of nested
    mappings), and those keys' values by dotted path (``eval.seconds``)."""
    results: dict[str, Any] = {}
    measured: dict[str, Any] = {}
    for k, v in record.items():
        if MEASURED_KEY.search(str(k)):
            measured[str(k)] = v
        elif isinstance(v, Mapping):
            results[k], inner = split_measured(v)
            measured |= {f"{k}.{ik}": iv for ik, iv in inner.items()}
        else:
            results[k] = v
    return results, measured


def record_run_facts(reports_dir: str | os.PathLike[str], stage: str, facts: Mapping[str, Any]) -> None:
    """Keep what the latest run of ``stage`` measured or was handed (seconds, MLflow run ids) under ``run_facts``:
    facts of the run, apart from its results."""
    reports = Path(reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    data = read(reports)
    data.setdefault("run_facts", {})[stage] = {
        "recorded_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **facts,
    }
    data["run_facts"] = dict(sorted(data["run_facts"].items()))
    write_json(reports / FILE, data)


def write_results(path: str | os.PathLike[str], record: Mapping[str, Any], *, stage: str) -> dict[str, Any]:
    """Write a stage's report ``record`` to ``path`` without its wall-clock keys, which go to the stage's
    ``run_facts`` beside it (``path``'s folder is the reports folder); returns what was written."""
    results, measured = split_measured(record)
    write_json(path, results)
    if measured:
        record_run_facts(Path(path).parent, stage, measured)
    return results


def mismatches(reports_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> dict[str, str]:
    """Report files whose content no longer matches their entry, or that have none: ``{path: why}``."""
    reports, root = Path(reports_dir), Path(root)
    files = read(reports)["files"]
    out = {}
    for p in sorted(reports.rglob("*")):
        if not p.is_file() or p.name == FILE or p.name.startswith("."):
            continue
        key = os.path.relpath(p.resolve(), root.resolve())
        entry = files.get(key)
        if entry is None:
            out[key] = "no provenance entry"
        elif entry["sha256"] != file_digest(p, "sha256"):
            out[key] = f"changed since {entry['stage']} wrote it at {entry['written_at']}"
    return out


def stamp_bench(out: str | os.PathLike[str], bench: str, args: Any, wall_s: float) -> None:
    """A bench's report ``out`` (in a ``reports/`` directory whose parent is the checkout) stamped with the bench's
    name and arguments (``argparse.Namespace`` or mapping) in place of params."""
    p = Path(out).resolve()
    root = p.parent.parent
    given = vars(args) if hasattr(args, "__dict__") else dict(args)

    def portable(v: Any) -> Any:  # the project records paths relative to its root
        if isinstance(v, os.PathLike) or (isinstance(v, str) and os.path.isabs(v)):
            q = Path(v).resolve()
            return q.relative_to(root).as_posix() if q.is_relative_to(root) else str(v)
        return v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)

    clean = {k: portable(v) for k, v in given.items()}
    stamp(p.parent, [p], stage=f"bench:{bench}", root=root, wall_s=wall_s, args=clean)
