"""The package layout (scripts/check_layout.py) holds, and each of its rules catches the fault it names."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

_spec = importlib.util.spec_from_file_location("check_layout", REPO / "scripts" / "check_layout.py")
layout = importlib.util.module_from_spec(_spec)
sys.modules["check_layout"] = layout  # dataclasses look their module up while the script loads
_spec.loader.exec_module(layout)


def test_the_layout_holds():
    assert layout.check(REPO) == []


def test_the_script_exits_0_and_names_every_layer():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_layout.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("layout holds")
    for group in layout.LAYERS:
        assert f"layer {layout.LAYERS.index(group)}: {', '.join(group)}" in out.stdout


@pytest.fixture()
def tree(tmp_path):
    """A copy of the package and flows to plant faults in."""
    for d in ("citer", "flows"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path, text):
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_a_cycle_and_an_upward_import_are_caught(tree):
    _append(
        tree / "citer" / "data" / "formats.py", "\n\ndef _late():\n    from citer.data import jsonl  # noqa\n"
    )
    _append(
        tree / "citer" / "decoding" / "cost.py",
        "\nfrom citer.evaluation.sweep_rows import SweepRow  # noqa\n",
    )
    problems = layout.check(tree)
    assert "import cycle: citer.data.answers <-> citer.data.formats <-> citer.data.jsonl" in problems
    assert any(
        "citer.decoding.cost (layer 2) imports citer.evaluation.sweep_rows (layer 3), a layer above it" in p
        for p in problems
    )


def test_tools_unknown_modules_plain_flow_functions_and_shared_names_are_caught(tree):
    _append(tree / "citer" / "decoding" / "engine.py", "\nimport mlflow  # noqa\n")
    _append(tree / "citer" / "routing" / "mlp.py", "\n\ndef _f():\n    import prefect  # noqa\n")
    (tree / "citer" / "misc.py").write_text("X = 1\n")
    (tree / "citer" / "serving" / "io.py").write_text("X = 1\n")
    _append(tree / "flows" / "synth.py", "\n\ndef choose_things(p):\n    return p\n")
    problems = "\n".join(layout.check(tree))
    assert (
        "citer/decoding/engine.py: imports mlflow; only citer.tracking, citer.routing.pyfunc, flows may"
        in problems
    )
    assert "citer/routing/mlp.py: imports prefect; only flows, citer.cli.prefect_server may" in problems
    assert "citer/misc.py: module citer.misc is in no layer" in problems
    assert "io.py: one name for 2 modules (citer/ops/io.py, citer/serving/io.py)" in problems
    assert "flows/synth.py: function choose_things is neither a @flow nor a @task" in problems


def test_a_long_module_is_named_for_review_not_failed(tree):
    """Split by concept, not size: past REVIEW_LINES a module is a warning, and the layout still holds."""
    _append(tree / "citer" / "ops" / "io.py", "\n" * layout.REVIEW_LINES)
    assert layout.check(tree) == []
    assert any(
        re.search(r"citer/ops/io\.py: \d+ lines \(more than 500\)", w) for w in layout.long_modules(tree)
    )


def test_a_room_may_span_layers():
    """The most specific entry places a module: the project-reading threads sit above the rest of citer.ops."""
    assert layout.layer_of("citer.ops.io") == 0 and layout.layer_of("citer.ops.threads") == 4
    assert (
        layout.layer_of("citer.tracking.provenance") == 0 and layout.layer_of("citer.tracking.registry") == 4
    )
    assert layout.layer_of("citer.routing.workers") == 4 and layout.layer_of("citer.routing.mlp") == 3


def test_dvc_code_dependencies_exist():
    """Every ``citer/...`` or ``flows/...`` dependency of a dvc stage names a file or folder that exists."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    deps = [d for s in stages.values() for d in s.get("deps", []) if d.startswith(("citer/", "flows/"))]
    assert deps and [d for d in deps if not (REPO / d).exists()] == []


def test_the_readme_map_names_the_rooms_as_they_are():
    """README's Development map: every room of citer/ is there, and every module it names lives in that room."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## Development") :].split("```")[1]
    named: dict[str, set[str]] = {}
    room = None
    for line in block.splitlines():
        head = re.match(r"(citer/\w*/?|flows/|[a-z]+/)", line)  # bench/, tests/ ... end the room above
        if head:
            room = head.group(1)
        if room is not None and room.endswith("/"):
            named.setdefault(room, set()).update(
                re.findall(r"\b(\w+)\.py\b", line[len(head.group(1)) if head else 0 :])
            )
    rooms = {f"citer/{d.name}/" for d in (REPO / "citer").iterdir() if (d / "__init__.py").is_file()}
    assert rooms <= set(named), rooms - set(named)
    missing = {f"{r}{m}.py" for r, ms in named.items() for m in ms if not (REPO / r / f"{m}.py").is_file()}
    assert missing == set()


def test_a_stage_dep_missing_for_code_it_runs_is_caught_and_written_back(tree):
    """Rule 6: each stage's deps cover every module its command imports, transitively; ``--deps`` writes them."""
    shutil.copy2(REPO / "dvc.yaml", tree / "dvc.yaml")
    assert layout.check(tree) == []
    text = (tree / "dvc.yaml").read_text(encoding="utf-8")
    sweep = text.index("\n  sweep:")
    cut = text[:sweep] + text[sweep:].replace("      - flows/runners.py\n", "", 1)
    assert cut != text
    (tree / "dvc.yaml").write_text(cut, encoding="utf-8")
    assert layout.check(tree) == [
        "dvc.yaml: stage sweep runs flows/runners.py (imported by flows.sweep_and_promote) but no dep covers it: "
        "add it or its folder"
    ]
    # A lazy import inside a function counts too: a new helper module a stage's code reaches makes it a dep.
    (tree / "citer" / "data" / "helper.py").write_text("X = 1\n")
    _append(
        tree / "citer" / "data" / "synth.py", "\n\ndef _late():\n    from citer.data import helper  # noqa\n"
    )
    assert "dvc.yaml: stage synth runs citer/data/helper.py (imported by citer.data.synth)" in "\n".join(
        layout.check(tree)
    )
    assert "sweep" in layout.write_code_deps(tree) and layout.check(tree) == []
    written = (tree / "dvc.yaml").read_text(encoding="utf-8")
    assert "      - flows/runners.py\n" in written[written.index("\n  sweep:") :]
    assert written.count("\n#") == text.count("\n#")  # the comments stay
