"""The public API: ``import citer`` is light, every name of ``__all__`` resolves, and the README's snippets run."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

import citer


def test_import_citer_loads_no_heavy_stack():
    code = "import sys, citer; print(sorted(m for m in ('torch', 'transformers', 'mlflow', 'prefect') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_to_its_definition():
    import importlib

    assert set(citer.__all__) == set(citer._API) | {"__version__"}
    for name, module in citer._API.items():
        assert getattr(citer, name) is getattr(importlib.import_module(module), name)
        assert name in dir(citer)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        citer.nope  # noqa: B018


def _readme_python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_snippets_run(champion_project, capsys):
    """In a project whose models, router and registered champion are where the README says, both snippets run."""
    blocks = _readme_python_blocks()
    assert len(blocks) == 2
    champion_lines = [ln for ln in blocks[0].splitlines() if ln.strip() and not ln.startswith("import")]
    assert len(champion_lines) <= 5  # the README promises loading the champion and generating in five lines
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    champ, out = scope["champ"], scope["out"]
    assert champ.info["version"] == "1" and champ.engine.tau == 0.5
    assert 1 <= len(out.tokens[0]) <= 64 and "of tokens by the LLM" in capsys.readouterr().out
    scope = {}
    exec(compile(blocks[1], "README.md", "exec"), scope)  # noqa: S102
    engine, tok = scope["engine"], scope["tok"]
    ids = tok.encode("Question: What is 2 + 3?\nAnswer:", add_special_tokens=False)
    assert engine.generate(ids, max_new_tokens=64).tokens == out.tokens  # the same router, pair and tau
