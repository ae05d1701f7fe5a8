"""Rows longer than the models' context: counted as labels count them, all reported at once, from the CLI too."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import SHARED_DATA, make_char_tokenizer, needs_shared_data
from typer.testing import CliRunner

from citer.cli import app
from citer.data.jsonl import read_jsonl
from citer.data.lengths import ContextBudget, context_limit, load_budget, sequence_lengths
from citer.data.validate import validate_file
from citer.routing.labels import encode_rows

runner = CliRunner()


def _math(problem: str) -> dict:
    return {"problem": problem, "solution": f"{problem} is \\boxed{{1}}."}


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


@pytest.fixture()
def three_long(tmp_path) -> Path:
    # Lines 3, 5 and 7 are too long for a 120-token context (char tokenizer: one token per character); line 2 is
    # blank and must still count, so the lines reported are the file's own.
    return _write(
        tmp_path / "long.jsonl",
        [
            _math("1 + 1?"),
            "",
            _math("x" * 80),
            _math("2 + 2?"),
            _math("y" * 90),
            _math("3 + 3?"),
            _math("z" * 70),
        ],
    )


def test_lengths_are_the_labels_encoding(char_tokenizer):
    rows = [_math("1 + 1?"), _math("a longer problem " * 5)]
    enc = encode_rows(char_tokenizer, rows, "math")  # target ends in EOS there too
    assert sequence_lengths(rows, "math", char_tokenizer) == [len(e.prompt) + len(e.target) for e in enc]


def test_three_long_rows_one_report(three_long, char_tokenizer):
    budget = ContextBudget(char_tokenizer, 120, "m: max_position_embeddings=120")
    report = validate_file(three_long, "math", budget=budget)
    assert not report.ok
    assert [(f.line, f.field) for f in report.errors()] == [
        (3, "prompt+target"),
        (5, "prompt+target"),
        (7, "prompt+target"),
    ]
    assert report.context == {"limit": 120, "source": budget.source, "n_over": 3, "lines": [3, 5, 7]}
    assert (
        "3 row(s) longer than the context of 120 tokens (m: max_position_embeddings=120): lines 3, 5, 7"
        in (report.summary())
    )
    assert "more than the context of 120 tokens" in report.errors()[0].reason
    # Without a budget the same file passes: the length is the only thing wrong with it.
    assert validate_file(three_long, "math").ok
    assert validate_file(three_long, "math", budget=ContextBudget(char_tokenizer, 512, "big")).ok


def test_context_limit_takes_the_smaller_stated_limit():
    tok = make_char_tokenizer()
    cfg = SimpleNamespace(max_position_embeddings=512)
    assert context_limit("m", cfg, tok) == (512, "m: max_position_embeddings=512")  # model_max_length is 1e30
    tok.model_max_length = 256
    assert context_limit("m", cfg, tok) == (256, "m: tokenizer model_max_length=256")
    tok.model_max_length = int(1e30)
    with pytest.raises(ValueError, match="m: field max_position_embeddings: missing"):
        context_limit("m", SimpleNamespace(), tok)


def test_load_budget_reads_a_model_directory(tiny_pair_dirs, tmp_path):
    budget = load_budget([str(d) for d in tiny_pair_dirs])
    assert budget.limit == 512 and str(tiny_pair_dirs[0]) in budget.source
    with pytest.raises(ValueError, match="absent: cannot read the model's config"):
        load_budget([str(tmp_path / "absent")])


def test_cli_model_option_lists_every_long_row(project, tiny_pair_dirs):
    long = [_math("q" * 600) for _ in range(3)]  # 600+ characters each, the tiny models hold 512 positions
    data = _write(project / "d.jsonl", [_math("1 + 1?"), long[0], "", long[1], _math("2 + 2?"), long[2]])
    args = [
        "data",
        "validate",
        str(data),
        "-f",
        "math",
        "--model",
        str(tiny_pair_dirs[0]),
        "--report",
        "r.json",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert "3 row(s) longer than the context of 512 tokens" in res.output and "lines 2, 4, 6" in res.output
    report = json.loads((project / "r.json").read_text())["files"][0]
    assert report["context"]["lines"] == [2, 4, 6] and report["n_errors"] == 3
    # The same file without --model and without params: nothing to measure against, the file passes.
    assert runner.invoke(app, ["data", "validate", str(data), "-f", "math"]).exit_code == 0


def _params(project: Path, data: Path, slm: Path, llm: Path, bootstrap: bool) -> None:
    params = {
        "data": {"format": "math", "train": str(data), "dev": str(data), "test": str(data)},
        "models": {"slm": str(slm), "llm": str(llm)},
        "bootstrap": {"enabled": bootstrap},
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")


def test_pipeline_validate_uses_the_params_pair_once_known(prefect_server, project, tiny_pair_dirs):
    from flows.validate import validate_flow

    data = _write(project / "train.jsonl", [_math("1 + 1?"), _math("q" * 600)])
    _params(project, data, *tiny_pair_dirs, bootstrap=False)
    reports = validate_flow("params.yaml")
    assert [r["context"]["lines"] for r in reports] == [[2]] * 3 and not any(r["ok"] for r in reports)
    # With bootstrap on, the models are built after this stage: the check is skipped and the report says so.
    _params(project, data, *tiny_pair_dirs, bootstrap=True)
    reports = validate_flow("params.yaml")
    assert all(r["ok"] and "bootstrap.enabled is true" in r["context"]["skipped"] for r in reports)
    assert "context length not checked: bootstrap.enabled is true" in reports[0]["summary"]


@needs_shared_data
def test_gsm8k_against_a_256_token_context():
    # The char tokenizer counts characters: GSM8K test rows over 256 characters of prompt + reference.
    path = SHARED_DATA / "math" / "gsm8k_test.jsonl"
    tok = make_char_tokenizer()
    report = validate_file(path, "math", budget=ContextBudget(tok, 256, "chars"))
    lengths = sequence_lengths(read_jsonl(path, "math"), "math", tok)
    assert report.context["n_over"] == sum(n > 256 for n in lengths) > 100
    assert report.n_errors == report.context["n_over"] and report.n_rows == 1319
