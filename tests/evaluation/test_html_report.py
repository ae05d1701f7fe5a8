"""reports/report.html: built from the committed reports and a predictions file, and rendered by a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from conftest import REPO

from citer.evaluation.html_report import build_report, write_report

PREDS = [
    {"index": 0, "response": "3 + 4 = 7. Thus 7.", "correct": True, "n_tokens": 9, "llm_tokens": 1,
     "spans": [["3 + 4 = ", "slm"], ["7", "llm"], [". Thus 7.", "slm"]]},
    {"index": 1, "response": "<b>x</b> = 2", "correct": False, "n_tokens": 5, "llm_tokens": 2,
     "spans": [["<b>x</b>", "llm"], [" = ", "slm"], ["3", "rolled_back"], ["2", "llm"]]},
    {"index": 2, "error": "field 'problem': missing required key"},
]  # fmt: skip


def _preds(tmp_path):
    p = tmp_path / "predictions.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PREDS))
    return p


def test_report_holds_the_headline_every_method_and_the_token_view(tmp_path):
    page = build_report(REPO / "reports", _preds(tmp_path))
    assert page.count('class="tok llm"') == 3 and page.count('class="tok slm"') == 3
    assert "3 LLM pieces, 3 SLM pieces shown" in page
    assert page.count('class="tok rolled_back"') == 1  # struck through, counted as neither writer
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # model text is escaped, never markup
    promo = json.loads((REPO / "reports" / "promotion.json").read_text())
    assert f"τ {promo['tau']:.3f}" in page and "chosen on dev" in page
    for r in json.loads((REPO / "reports" / "sweep.json").read_text()):
        if r.get("tau") is None or r.get("selected_on_dev"):
            assert f"<td>{r['method']}</td>" in page
    assert re.search(r'src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', page) or "(no pareto.png)" in page
    assert "<script" not in page and "http" not in page.split("<body>")[1]  # self-contained, nothing fetched


def test_report_without_predictions_says_how_to_get_them(tmp_path):
    page = build_report(REPO / "reports", tmp_path / "missing.jsonl")
    assert (
        "run <code>citer route</code>" in page
        and 'class="tok' not in page.split("</style>")[1].split("key")[0]
    )


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.slow
@pytest.mark.skipif(
    _browser() is None, reason="no headless Chromium here (scripts/setup.sh installs it with apt)"
)
def test_a_browser_renders_the_report(tmp_path):
    out = write_report(REPO / "reports", _preds(tmp_path), tmp_path / "report.html")
    base = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run([*base, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout  # fmt: skip
    # The DOM the browser built, not the file's text: the spans a reader sees, coloured by writer.
    assert len(re.findall(r'<span class="tok llm"', dom)) == 3
    assert len(re.findall(r'<span class="tok slm"', dom)) == 3
    assert "Who wrote which token" in dom and "Headline" in dom
    shot = tmp_path / "report.png"
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,1600", out.as_uri()], capture_output=True,
                   timeout=120, check=True)  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_report_names_the_question_the_promoted_method_and_the_run(tmp_path):
    """The token view shows what was asked; the bold row is the promoted method (not always citer); the page says
    which params the sweep ran with and where its run is recorded (nothing that differs between two runs of the same
    code: the page is a result file); nothing promoted leads the page."""
    reports = tmp_path / "reports"
    shutil.copytree(REPO / "reports", reports)
    preds = [dict(PREDS[0], question="Tom has 3 coins and gets 4. How many coins now?")]
    out = tmp_path / "predictions.jsonl"
    out.write_text(json.dumps(preds[0]) + "\n")
    promo = json.loads((reports / "promotion.json").read_text())
    promo |= {"method": "citer_verify", "promoted": 1}
    (reports / "promotion.json").write_text(json.dumps(promo))
    page = build_report(reports, out)
    assert '<p class="question">Tom has 3 coins and gets 4. How many coins now?</p>' in page
    bold = re.findall(r'<tr class="promoted"><td>([a-z_]+)</td>', page)
    assert bold == ["citer_verify"], bold
    sweep_entry = json.loads((reports / "provenance.json").read_text())["files"]["reports/sweep.json"]
    assert f"Sweep of params {sweep_entry['params_digest']}; the run that wrote it" in page
    assert sweep_entry["written_at"] not in page and sweep_entry["commit"][:12] not in page
    assert 'class="status"' not in page

    (reports / "promotion.json").write_text(
        json.dumps(promo | {"promoted": 0, "reason": "too few questions"})
    )
    page = build_report(reports, out)
    assert '<p class="status">not promoted: too few questions</p>' in page and 'class="promoted"' not in page
    out.with_name("predictions.jsonl.meta.json").write_text(json.dumps({"status": "no champion: too few"}))
    assert '<p class="status">no champion: too few</p>' in build_report(reports, out)
