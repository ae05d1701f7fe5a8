"""Which label and router iterations on disk are current: fingerprints of their inputs, and stale iterations.

Each label set and router records a ``fingerprint`` in its meta: a digest of everything it was made from (the
models, the train file, the params, the previous iteration's artifacts and the code that makes it). A rerun whose
inputs have the same fingerprint keeps the artifact instead of recollecting it, so a DVC stage that owns every
iteration can rerun cheaply when only a later step's params changed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from citer.ops.io import file_digest

# Model files above this size are sampled (head, tail, size) instead of read whole: a 144 GB LLM is not rehashed.
_WHOLE_FILE_BYTES = 1 << 20
_SAMPLE_BYTES = 1 << 20

LABELS_CODE = (
    "citer.routing.labels",
    "citer.routing.rollouts",
    "citer.routing.shards",  # sharding must not change labels; a change to how shards merge recollects them anyway
    "citer.routing.label_store",
    "citer.decoding",
    "citer.data.answers",
    "citer.data.prompts",
    "citer.data.jsonl",
)
ROUTER_CODE = (
    "citer.routing.fitting",
    "citer.routing.mlp",
    "citer.routing.features",
    "citer.routing.metrics",
    "citer.routing.label_store",
    "citer.routing.labels",
)


def fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 (first 24 hex digits) of ``parts`` as canonical JSON."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def _sampled_digest(path: Path) -> str:
    size = path.stat().st_size
    if size <= _WHOLE_FILE_BYTES:
        return file_digest(path)
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        h.update(fh.read(_SAMPLE_BYTES))
        fh.seek(max(size - _SAMPLE_BYTES, 0))
        h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def model_fingerprint(ref: str | os.PathLike[str]) -> str:
    """A local model directory's files (names, sizes, small files whole, weight files sampled), a model file (a
    ``.gguf``) alike; a hub id as is."""
    p = Path(ref)
    if p.is_file():
        return fingerprint({p.name: _sampled_digest(p)})
    if not p.is_dir():
        return f"hub:{ref}"
    files = sorted(f for f in p.rglob("*") if f.is_file())
    return fingerprint({str(f.relative_to(p)): _sampled_digest(f) for f in files})


def source_digest(modules: Iterable[str]) -> str:
    """Digest of the source files of ``modules`` (a package counts every ``.py`` file under it)."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"source_digest: module {name!r} not found")
        origin = Path(spec.origin)
        files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def dir_digest(directory: str | os.PathLike[str], files: Iterable[str]) -> str:
    """Digest of the named files of an artifact directory (what a later iteration was built from)."""
    d = Path(directory)
    return fingerprint({name: file_digest(d / name) if (d / name).is_file() else None for name in files})


def recorded_fingerprint(meta_path: str | os.PathLike[str]) -> str | None:
    """The ``fingerprint`` an artifact's meta file records, or None (no artifact, unreadable, or none recorded)."""
    try:
        meta = json.loads(Path(meta_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = meta.get("fingerprint") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def remove_stale_iterations(
    directory: str | os.PathLike[str],
    keep: int,
    prefix: str = "iter",
    ablations: Iterable[str] | None = None,
    ablation_prefix: str = "ablation_",
) -> list[Path]:
    """Delete the ``{prefix}{k}`` subdirectories and ``{prefix}{k}.json`` files of ``directory`` with k > ``keep``.

    With ``ablations`` (the names ``router.ablations`` lists), ``{ablation_prefix}{name}`` entries whose name is not
    listed go too; listed ones are kept. Without it, ablation entries are left alone.
    """
    d = Path(directory)
    removed: list[Path] = []
    if not d.is_dir():
        return removed
    listed = None if ablations is None else set(ablations)
    for child in sorted(d.iterdir()):
        stem = child.name.removesuffix(".json")
        k = stem[len(prefix) :]
        stale_iteration = stem.startswith(prefix) and k.isdigit() and int(k) > keep
        name = stem[len(ablation_prefix) :]
        stale_ablation = listed is not None and stem.startswith(ablation_prefix) and name not in listed
        if not (stale_iteration or stale_ablation):
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
        removed.append(child)
    return removed


class ProvenanceError(ValueError):
    """Labels or a router made with another model pair than the one in use."""


def pair_digests(slm_ref: str | os.PathLike[str], llm_ref: str | os.PathLike[str]) -> dict[str, str]:
    """``slm_digest``/``llm_digest``: what labels and routers record of the pair that made them
    (:func:`model_fingerprint`: a local directory's files, a hub id as is)."""
    return {"slm_digest": model_fingerprint(slm_ref), "llm_digest": model_fingerprint(llm_ref)}


def check_provenance(
    meta: Mapping[str, Any], want: Mapping[str, str], where: str, roles: Iterable[str]
) -> None:
    """Refuse ``meta`` (a label set's or router's) unless it records the digests ``want`` (:func:`pair_digests`) for
    every role in ``roles`` (``slm``, ``llm``); one line naming the artifact, the role and both models."""
    for role in roles:
        key = f"{role}_digest"
        got = meta.get(key)
        if got is None:
            raise ProvenanceError(
                f"{where}: records no {key} (made before provenance was recorded); collect it again with the pair "
                "in use"
            )
        if got != want[key]:
            raise ProvenanceError(
                f"{where}: made with {role.upper()} {meta.get(role)!r} ({got}), but the {role.upper()} in use is "
                f"{want[key]}; collect labels / train the router again for this pair"
            )
