"""citer.project: a project's root, params and the paths, models and stores every stage resolves through it."""

from __future__ import annotations

import pytest

from citer.config import ConfigError, Params
from citer.project import Project, as_project, load_project, project_root


def _project(root, **blocks) -> Project:
    return Project(root=root, params=Params.model_validate(blocks))


def test_paths_resolve_against_the_root(tmp_path):
    proj = _project(tmp_path)
    assert proj.path("reports") == tmp_path / "reports"
    assert proj.path("/abs/file.jsonl").as_posix() == "/abs/file.jsonl"
    assert proj.reports == tmp_path / "reports"
    assert proj.labels_dir(2) == tmp_path / "artifacts" / "labels" / "iter2"
    assert proj.router_dir("citer_s") == tmp_path / "artifacts" / "routers" / "citer_s"


def test_model_refs_are_local_dirs_or_hub_ids(tmp_path):
    (tmp_path / "models" / "slm").mkdir(parents=True)
    proj = _project(tmp_path, models={"slm": "models/slm_base", "llm": "Qwen/Qwen2-72B"})
    assert proj.slm_name == "models/slm"  # finetuning on: routing uses the finetuned SLM
    assert proj.slm_ref == str(tmp_path / "models" / "slm")
    assert proj.llm_ref == "Qwen/Qwen2-72B"  # not a directory here: a hub id, passed through
    off = _project(tmp_path, models={"slm": "Qwen/Qwen2-1.5B"}, finetune={"enabled": False})
    assert off.slm_name == off.slm_ref == "Qwen/Qwen2-1.5B"


def test_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert _project(tmp_path).tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    remote = _project(tmp_path, paths={"mlflow_tracking_uri": "http://127.0.0.1:5000"})
    assert remote.tracking_uri == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/m.db")
    assert _project(tmp_path).tracking_uri == "sqlite:////elsewhere/m.db"


def test_validation_files_default_to_the_splits(tmp_path):
    mc = {"format": "mc", "train": "t.jsonl", "dev": "d.jsonl", "test": "e.jsonl"}
    proj = _project(tmp_path, data=mc, bootstrap={"formats": ["math", "mc"]})
    assert proj.validation_files() == [(str(tmp_path / f), "mc") for f in ("t.jsonl", "d.jsonl", "e.jsonl")]
    listed = _project(tmp_path, validate={"files": [["x.jsonl", "math"], ["/abs/y.jsonl", "mc"]]})
    assert listed.validation_files() == [(str(tmp_path / "x.jsonl"), "math"), ("/abs/y.jsonl", "mc")]


def test_load_project_root_and_params(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text("registry:\n  model_name: mine\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CITER_ROOT", raising=False)
    assert project_root() == tmp_path.resolve()
    assert load_project().params.registry.model_name == "mine"
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("CITER_ROOT", str(other))
    assert project_root() == other.resolve()
    assert load_project(optional=True).params == Params()  # no params file there: the defaults
    with pytest.raises(ConfigError, match="params file not found"):
        load_project()
    assert load_project(root=tmp_path).root == tmp_path.resolve()
    (other / "params.yaml").write_text("router:\n  lr: fast\n")
    with pytest.raises(ConfigError, match="router.lr"):
        load_project(optional=True)  # a malformed file is never replaced by the defaults


def test_as_project_takes_a_project_or_its_directory(tmp_path):
    (tmp_path / "params.yaml").write_text("registry:\n  alias: best\n")
    proj = _project(tmp_path)
    assert as_project(proj) is proj
    assert as_project(tmp_path).params.registry.alias == "best" and as_project(str(tmp_path)).root == tmp_path


def test_portable_refs_are_relative_inside_the_root(tmp_path):
    """What the registry records: a path inside the project relative to it, one outside absolute, a hub id as is."""
    (tmp_path / "proj" / "models" / "slm").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    proj = _project(tmp_path / "proj")
    assert proj.portable_ref("models/slm") == "models/slm"
    assert proj.portable_ref(str(tmp_path / "proj" / "models" / "slm")) == "models/slm"
    assert proj.portable_ref(str(tmp_path / "shared")) == str(tmp_path / "shared")
    assert proj.portable_ref("Qwen/Qwen2-1.5B") == "Qwen/Qwen2-1.5B"
    assert proj.same_ref("models/slm", str(tmp_path / "proj" / "models" / "slm"))
    assert not proj.same_ref("models/slm", str(tmp_path / "shared"))
    assert proj.same_ref("Qwen/Qwen2-1.5B", "Qwen/Qwen2-1.5B") and not proj.same_ref("Qwen/a", "Qwen/b")
