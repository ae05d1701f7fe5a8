"""A citer project on disk: its root directory, its params, and the paths and models the stages use.

Params hold paths relative to the project root (or hub ids); :class:`Project` resolves them, so every stage, the CLI
and the Python API (:func:`citer.load_champion`) agree on where things are. The root is ``CITER_ROOT`` when set (a
deployment worker), else the current directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from citer.config import Params, load_params


def project_root() -> Path:
    """The project directory: ``CITER_ROOT`` if set, else the current directory."""
    return Path(os.environ.get("CITER_ROOT", os.getcwd())).resolve()


@dataclass(frozen=True)
class Project:
    """A project's root directory and its params."""

    root: Path
    params: Params

    def path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def model_ref(self, name: str) -> str:
        """A model directory under the project when it exists there, else the name as given (a hub id)."""
        local = self.path(name)
        return str(local) if local.exists() else name

    def portable_ref(self, name: str | os.PathLike[str]) -> str:
        """How the project records a model or file: relative to the root when it lies inside it (so a copied project
        names its own copy), else absolute (a shared directory outside), else as given (a hub id)."""
        p = Path(name)
        local = self.path(str(p))
        if not local.exists():
            return str(name)
        try:
            return local.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return str(local.resolve())

    def same_ref(self, a: str, b: str) -> bool:
        """Whether two recorded refs name the same model: the same directory once resolved, or the same hub id."""
        la, lb = self.path(a), self.path(b)
        if la.exists() and lb.exists():
            return la.resolve() == lb.resolve()
        return a == b

    @property
    def slm_name(self) -> str:
        """The SLM as params name it (project-relative), the identity routers and labels record."""
        m = self.params.models
        return m.finetuned_slm if self.params.finetune.enabled else m.slm

    @property
    def slm_ref(self) -> str:
        """The SLM that routing uses: the finetuned one unless finetuning is off."""
        return self.model_ref(self.slm_name)

    @property
    def llm_ref(self) -> str:
        return self.model_ref(self.params.models.llm)

    def labels_dir(self, iteration: int | str) -> Path:
        return self.path(self.params.paths.labels_dir) / (
            f"iter{iteration}" if isinstance(iteration, int) else iteration
        )

    def router_dir(self, iteration: int | str) -> Path:
        return self.path(self.params.paths.routers_dir) / (
            f"iter{iteration}" if isinstance(iteration, int) else iteration
        )

    def method_router_dir(self, method: str) -> Path:
        """The directory of the router a sweep method decodes with: ``citer`` the last iteration's, ``citer_iter1``
        iteration 1's, ``citer_s`` CITER-S's, ``citer_<name>`` the input ablation ``name``'s, ``citer@<tag>`` the
        CITER router at a ``router.layers_grid`` width (``router.layers``' own: the last iteration's)."""
        from citer.routing.architecture import LAYERS_METHOD, layers_tag

        if method.startswith(LAYERS_METHOD):
            tag = method.removeprefix(LAYERS_METHOD)
            if tag != layers_tag(self.params.router.layers):
                return self.router_dir(f"layers_{tag}")
            method = "citer"
        if method == "citer":
            return self.router_dir(self.params.labels.iterations)
        if method == "citer_iter1":
            return self.router_dir(1)
        if method == "citer_s":
            return self.router_dir("citer_s")
        return self.path(self.params.paths.routers_dir) / f"ablation_{method.removeprefix('citer_')}"

    def router_inputs(self, router_dir: Path) -> list[str]:
        """What a saved router reads (its ``features``), as its ``router.json`` records."""
        import json

        from citer.routing.mlp import META_FILE

        meta = json.loads((router_dir / META_FILE).read_text(encoding="utf-8"))
        return list(meta.get("features", ["hidden"]))

    @property
    def reports(self) -> Path:
        return self.path(self.params.paths.reports_dir)

    @property
    def tracking_uri(self) -> str:
        """``MLFLOW_TRACKING_URI`` wins; else params, with a relative sqlite path made absolute against the root."""
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.params.paths.mlflow_tracking_uri
        prefix = "sqlite:///"
        if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
            uri = prefix + str(self.root / uri[len(prefix) :])
        return uri

    def validation_files(self) -> list[tuple[str, str]]:
        """``(path, format)`` of every file the validate stage checks: ``validate.files``, else the data splits."""
        p = self.params
        if p.validate_.files:
            return [(str(self.path(f)), fmt) for f, fmt in p.validate_.files]
        return [(str(self.path(s)), p.data.format) for s in (p.data.train, p.data.dev, p.data.test)]

    def load_pair(self) -> tuple[Any, Any, Any]:
        """``(slm, llm, tokenizer)`` as params say (dtype, device, the LLM's device_map, remote code)."""
        from citer.models.loading import load_pair

        m = self.params.models
        return load_pair(
            self.slm_ref,
            self.llm_ref,
            m.dtype,
            m.device,
            m.trust_remote_code,
            llm_device_map=m.llm_device_map,
        )

    def read_split(self, split: str) -> list[dict[str, Any]]:
        """The rows of ``data.<split>`` (train, dev or test) in ``data.format``."""
        from citer.data.jsonl import read_jsonl

        d = self.params.data
        return read_jsonl(self.path(getattr(d, split)), d.format)


def load_project(
    params_path: str | os.PathLike[str] = "params.yaml",
    optional: bool = False,
    root: str | os.PathLike[str] | None = None,
) -> Project:
    """The project at ``root`` (default :func:`project_root`) with its params file (relative to the root).

    With ``optional`` a missing params file means the defaults; a malformed one never does.
    """
    base = Path(root).resolve() if root is not None else project_root()
    p = Path(params_path)
    p = p if p.is_absolute() else base / p
    if optional and not p.exists():
        return Project(root=base, params=Params())
    return Project(root=base, params=load_params(p))


def as_project(project: Project | str | os.PathLike[str]) -> Project:
    """``project`` itself, or the project whose directory it names (its ``params.yaml`` is read)."""
    return project if isinstance(project, Project) else load_project(root=project)
