"""The docs quote the committed reports, and the reports are what a named run wrote (citer.evaluation.headline)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO

from citer.evaluation.docs_blocks import BLOCKS, blocks_in, render_blocks, rewrite
from citer.ops.io import file_digest
from citer.tracking import provenance

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_measured_block_is_what_the_committed_reports_render(doc):
    held = blocks_in(doc.read_text(encoding="utf-8"))
    fresh = render_blocks(REPO / "reports", list(held))
    for name, body in held.items():
        assert body == fresh[name][0], (
            f"{doc.name}: block {name!r} differs from reports/ (run `citer report docs`)"
        )


def test_the_docs_quote_the_headline_and_every_file_they_read_is_a_named_runs():
    quoted = {n for d in DOCS for n in blocks_in(d.read_text(encoding="utf-8"))}
    assert {"headline", "sweep", "pipeline", "engine"} <= quoted
    files = {f for n in quoted for f in render_blocks(REPO / "reports", [n])[n][1]}
    entries = provenance.read(REPO / "reports")["files"]
    for f in sorted(files - {provenance.FILE}):
        e = entries.get(f"reports/{f}")
        assert e is not None, f"reports/{f} has no provenance entry"
        assert e["sha256"] == file_digest(REPO / "reports" / f), f"reports/{f} changed after its run"
        assert e["commit"] != "unknown" and not e["commit"].endswith("+dirty"), (f, e["commit"])
        assert e["machine"]["cores"] and e["machine"]["torch"] and e["stage_wall_s"] >= 0


def test_rewrite_fills_blocks_and_refuses_unknown_ones(tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(REPO / "reports", reports)
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- citer:sweep -->\nstale\n<!-- /citer:sweep -->\nend\n")
    assert rewrite(doc, reports) == ["sweep"]
    body = blocks_in(doc.read_text())["sweep"]
    rows = json.loads((reports / "sweep.json").read_text())
    llm = next(r for r in rows if r["method"] == "llm")
    assert f"| llm | – | {llm['accuracy']:.3f}" in body and doc.read_text().endswith("end\n")
    # a per-CPU report renders under its own block name
    shutil.copy(reports / "bench_cpu_llama_cpp_routed.json", reports / "bench_cpu_llama_cpp_routed_zen9.json")
    doc.write_text("<!-- citer:llama_cpp_routed_zen9 -->\nx\n<!-- /citer:llama_cpp_routed_zen9 -->\n")
    assert rewrite(doc, reports) == ["llama_cpp_routed_zen9"]
    assert "From `reports/bench_cpu_llama_cpp_routed_zen9.json`" in doc.read_text()
    doc.write_text("<!-- citer:nope -->\nx\n<!-- /citer:nope -->\n")
    with pytest.raises(ValueError, match="unknown citer blocks"):
        rewrite(doc, reports)
    assert set(BLOCKS) >= {"headline", "sweep", "pipeline", "engine"}
