"""lm-evaluation-harness against a project's ``citer serve`` on an mc split: a loglikelihood task (how the harness runs
ARC, MMLU and CommonsenseQA: each choice's routed likelihood, no generation) and a generate task (the served
champion answers with its chain of thought; the letter it names is graded), both through the harness's own
OpenAI-compatible client with the tokenizer's chat template. ``python scripts/lm_eval_mc.py PROJECT [--split FILE]``.
An evaluation of a finished project, not a bench and not a CI test (the harness's clients against ``citer serve``
are tested in ``tests/serving/test_lm_eval.py``).

The loglikelihood continuation of a choice is `` The answer is {label}.``, the citer convention
(:func:`citer.evaluation.loglikelihood.choice_continuations`); a pair trained to reason first scores it zero-shot,
without its chain of thought. Writes ``PROJECT/reports/lm_eval_mc.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from citer.evaluation.loglikelihood import choice_continuations  # noqa: E402
from citer.ops.io import write_json  # noqa: E402


def task_files(root: Path, rows: list[dict], max_gen: int) -> None:
    flat = []
    for r in rows:
        labels, texts = r["choices"]["label"], r["choices"]["text"]
        choices = " ".join(f"({a}) {t}" for a, t in zip(labels, texts, strict=True))
        flat.append(
            {
                "text": f"{r['question']}\nChoices: {choices}",
                "conts": choice_continuations(r),
                "label": labels.index(r["answerKey"]),
                "answer": r["answerKey"],
            }
        )
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in flat), encoding="utf-8")
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "text",
    }
    ll = {"task": "citer_mc_ll", "output_type": "multiple_choice", "doc_to_choice": "conts",
          "doc_to_target": "label", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}  # fmt: skip
    gen = {
        "task": "citer_mc_gen",
        "output_type": "generate_until",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": max_gen, "do_sample": False},
        "filter_list": [{"name": "letter", "filter": [
            {"function": "regex", "regex_pattern": r"answer is \(?([A-Z])"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match"}],
    }  # fmt: skip
    for t in (ll, gen):
        (root / f"{t['task']}.yaml").write_text(yaml.safe_dump(common | t), encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("project", help="a project directory with a promoted champion")
    ap.add_argument("--split", default=None, help="mc JSONL (default: the project's data.test)")
    ap.add_argument("--limit", type=int, default=0, help="first N questions (0 = all)")
    ap.add_argument("--max-gen", type=int, default=96)
    args = ap.parse_args(argv)
    proj = Path(args.project).resolve()
    params = yaml.safe_load((proj / "params.yaml").read_text(encoding="utf-8"))
    split = Path(args.split) if args.split else proj / params["data"]["test"]
    rows = [json.loads(line) for line in split.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[: args.limit] if args.limit else rows
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "citer"), "serve", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=proj, env=os.environ | {"CITER_ROOT": str(proj)})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("citer serve did not come up in 120 s")
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        with tempfile.TemporaryDirectory() as tmp:
            task_files(Path(tmp), rows, args.max_gen)
            t0 = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={
                    "model": model,
                    "base_url": f"{base}/v1/completions",
                    "tokenizer_backend": "huggingface",
                    "tokenizer": str(proj / params["models"]["finetuned_slm"]),
                    "batch_size": 16,
                    "max_length": 512,
                },  # fmt: skip
                tasks=["citer_mc_ll", "citer_mc_gen"],
                task_manager=TaskManager(include_path=tmp),
                apply_chat_template=True,
                bootstrap_iters=0,
            )
            secs = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=30)
    res = out["results"]
    report = {
        "project": str(proj),
        "split": str(split),
        "n": len(rows),
        "loglikelihood_acc": res["citer_mc_ll"]["acc,none"],
        "loglikelihood_acc_norm": res["citer_mc_ll"]["acc_norm,none"],
        "generate_exact_match": res["citer_mc_gen"]["exact_match,letter"],
        "seconds": secs,
    }
    write_json(proj / "reports" / "lm_eval_mc.json", report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
