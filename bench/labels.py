"""Iteration-1 labelling time: citer's teacher-forced collection vs a per-token generate loop. ``python bench/labels.py``.

The per-token loop is the reference implementation's method: for every position t of every reference chain of thought,
one ``generate(max_new_tokens=1)`` call per model on prompt + target[:t] (the SLM's call also returns its last hidden
state, which the router needs). ``citer_seconds`` is the same work done citer's way (one teacher-forced pass per model
per batch), and ``speedup`` their ratio. The whole of iteration 1 adds the both-wrong rollouts, which citer batches
through the engine and the reference runs one ``generate`` per token (estimated from a sample of 20). Models: the
pair in ``models/`` and the first ``--n`` train rows when they exist, else untrained models of the embedded
architecture on synthesised rows (rollouts dominate there). Writes ``reports/bench_labels.json`` atomically.

``--scale-out`` measures the shard overhead instead (docs/scale_out.md): the same iteration-1 collection through the
``collect-labels`` flow in one process with ``--workers`` torch threads, then sharded on a local Dask cluster of
``--workers`` single-thread processes on the same cores (cold: each worker imports and loads the pair; warm: again),
and checks the labels are identical. Writes ``reports/bench_labels_scale_out.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from citer.config import BootstrapParams, LabelsParams, SynthParams, load_params  # noqa: E402
from citer.ops.io import write_json  # noqa: E402
from citer.routing.labels import collect_iter1, encode_rows, teacher_forced  # noqa: E402
from citer.tracking.provenance import stamp_bench  # noqa: E402


def load_setup(n: int) -> tuple[Any, Any, Any, list[dict[str, Any]], str, str]:
    """``(slm, llm, tokenizer, rows, fmt, description)``: the embedded pair when built, tiny models otherwise."""
    params = load_params(ROOT / "params.yaml") if (ROOT / "params.yaml").is_file() else None
    fmt = params.data.format if params else "math"
    if params is not None:
        m = params.models
        slm_dir = next(
            (ROOT / d for d in (m.finetuned_slm, m.slm) if (ROOT / d / "config.json").is_file()), None
        )
        if slm_dir and (ROOT / m.llm / "config.json").is_file() and (ROOT / params.data.train).is_file():
            from citer.data.jsonl import read_jsonl
            from citer.models.loading import load_pair

            slm, llm, tok = load_pair(slm_dir, ROOT / m.llm, "float32", "cpu")
            rows = read_jsonl(ROOT / params.data.train, fmt)[:n]
            return slm, llm, tok, rows, fmt, f"embedded pair: {slm_dir.relative_to(ROOT)} + {m.llm}"
    from citer.data.synth import synthesize
    from citer.models.bootstrap import build_model, build_tokenizer, corpus_texts

    train = synthesize(SynthParams(n_train=max(n, 200), n_dev=10, n_test=10))[f"{fmt}_train"]
    bp = BootstrapParams()
    tok = build_tokenizer(corpus_texts(train, fmt), bp.vocab_size)
    slm, llm = build_model(bp.slm, tok, seed=1).eval(), build_model(bp.llm, tok, seed=2).eval()
    return slm, llm, tok, train[:n], fmt, "untrained models of the embedded architecture (models/ not built)"


@torch.inference_mode()
def per_token_loop(slm: Any, llm: Any, tok: Any, enc: list[Any]) -> tuple[float, list[int]]:
    """The reference method; returns (seconds, SLM tokens) so the two methods can be checked to agree."""
    slm_tokens, pad = [], tok.pad_token_id
    t0 = time.perf_counter()
    for e in enc:
        for t in range(len(e.target)):
            ids = torch.tensor([e.prompt + e.target[:t]])
            out = slm.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=pad, output_hidden_states=True,
                               return_dict_in_generate=True)  # fmt: skip
            slm_tokens.append(int(out.sequences[0, -1]))
            llm.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t0, slm_tokens


@torch.inference_mode()
def reference_rollout_seconds(
    slm: Any, tok: Any, enc: list[Any], ls: Any, max_new_tokens: int, k: int
) -> float:
    """Mean time of one reference-style rollout (one ``generate`` per both-wrong token), over up to k of them."""
    bw = ls.tokens.index[ls.tokens["case"] == "both_wrong"].tolist()
    pick = bw[:: max(1, len(bw) // k)][:k]  # evenly spread, deterministic
    t0 = time.perf_counter()
    for i in pick:
        r = ls.tokens.loc[i]
        e = enc[int(r["example_id"])]
        ids = torch.tensor([e.prompt + e.target[: int(r["position"])] + [int(r["slm_token"])]])
        slm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                     eos_token_id=tok.eos_token_id)  # fmt: skip
    return (time.perf_counter() - t0) / len(pick) if pick else 0.0


def run(n: int, batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    slm, llm, tok, rows, fmt, desc = load_setup(n)
    params = LabelsParams(batch_size=batch_size, max_new_tokens=max_new_tokens)
    # Warm-up (first-call allocations, lazy imports) outside every timing.
    collect_iter1(slm, llm, tok, rows[:2], fmt, params.model_copy(update={"citer_s": True}))
    enc = encode_rows(tok, rows, fmt)  # tokenisation is outside every timing
    t0 = time.perf_counter()
    teacher_forced(slm, llm, enc, batch_size, tok.pad_token_id)
    tf_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ls = collect_iter1(slm, llm, tok, rows, fmt, params)
    citer_s = time.perf_counter() - t0
    loop_s, loop_slm = per_token_loop(slm, llm, tok, enc)
    agree = sum(int(a == b) for a, b in zip(loop_slm, ls.tokens["slm_token"].tolist(), strict=True))
    per_rollout = reference_rollout_seconds(slm, tok, enc, ls, max_new_tokens, k=20)
    ref_full = loop_s + per_rollout * int(ls.meta["n_rollouts"])
    # citer_seconds vs per_token_loop_seconds: like for like (next-token predictions of both models + SLM hidden
    # states at every target position). The whole iteration 1 (both-wrong rollouts included): citer batches them
    # through the engine, the reference runs one generate per token (estimated from a sample of 20 such calls).
    return dict(citer_seconds=round(tf_s, 3), per_token_loop_seconds=round(loop_s, 3), speedup=round(loop_s / tf_s, 2),
                citer_collect_iter1_seconds=round(citer_s, 3), reference_iter1_estimated_seconds=round(ref_full, 3),
                speedup_iter1_estimated=round(ref_full / citer_s, 2), reference_seconds_per_rollout=round(per_rollout, 4),
                n_examples=len(rows), n_tokens=ls.n_tokens, n_rollouts=int(ls.meta["n_rollouts"]),
                case_counts=ls.case_counts(), slm_argmax_agreement=round(agree / ls.n_tokens, 4), models=desc,
                format=fmt, batch_size=batch_size, max_new_tokens=max_new_tokens,
                torch_threads=torch.get_num_threads(), note="shared 2-core machine: timings are noisy")  # fmt: skip


def set_params(root: Path, **blocks: dict[str, Any]) -> None:
    """Update ``root/params.yaml``'s blocks with ``blocks``."""
    params = yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))
    for name, values in blocks.items():
        params.setdefault(name, {}).update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def timed_collect(root: Path) -> tuple[float, Any]:
    """Seconds of one iteration-1 collection through the collect-labels flow, and its label set."""
    from citer.project import load_project
    from flows.collect_preferences import collect
    from flows.runners import TaskRunners

    runner = TaskRunners.build(load_project(root=root).params.runtime)
    t0 = time.perf_counter()
    labelset, _ = collect.with_options(task_runner=runner)("params.yaml", 1)
    return time.perf_counter() - t0, labelset


def scale_out(n: int, workers: int, batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    from distributed import LocalCluster

    slm, llm, tok, rows, fmt, desc = load_setup(n)
    with tempfile.TemporaryDirectory(prefix="citer-bench-") as tmp:
        root = Path(
            tmp
        )  # a project holding the pair and the rows, with params for iteration-1 collection only
        for role, model in (("slm", slm), ("llm", llm)):
            model.save_pretrained(root / "models" / role)
            tok.save_pretrained(root / "models" / role)
        (root / "data").mkdir(parents=True)
        (root / "data" / "train.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8"
        )
        shutil.copy(ROOT / "params.yaml", root / "params.yaml")
        local = {"task_runner": "local", "workers": 1, "address": None}
        set_params(root, data=dict(format=fmt, train="data/train.jsonl", dev="data/train.jsonl", test="data/train.jsonl"),
                   models=dict(slm="models/slm", llm="models/llm", finetuned_slm="models/slm", device="cpu"),
                   finetune={"enabled": False}, runtime=local,
                   labels=dict(iterations=1, n_examples=n, batch_size=batch_size, max_new_tokens=max_new_tokens))  # fmt: skip
        os.environ["CITER_ROOT"] = str(root)
        os.chdir(root)
        from flows.common import quiet_defaults

        quiet_defaults(root)  # Prefect's temporary server and state inside the temporary project
        torch.set_num_threads(1)
        timed_collect(root)  # warm-up outside every timing: Prefect's server, imports, first allocations
        one_thread_s, one = timed_collect(root)
        torch.set_num_threads(workers)  # one process on all the cores the cluster below gets
        threads_s, _ = timed_collect(root)
        local_s = min(one_thread_s, threads_s)  # the better single process is the baseline
        t0 = time.perf_counter()
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        )
        start_s = time.perf_counter() - t0
        try:
            dask = dict(task_runner="dask", workers=workers, address=cluster.scheduler_address)
            set_params(root, runtime=local | dask)
            cold_s, _ = timed_collect(root)
            warm_s, many = timed_collect(root)
        finally:
            cluster.close()
    same = one.tokens.equals(many.tokens) and one.hidden.numpy().tobytes() == many.hidden.numpy().tobytes()
    # first run: the workers import torch/citer and load the pair; shard overhead: dispatch, transport, imbalance
    # (negative: it pays); tiny models lose to thread overhead in one process.
    return {"in_process_1_thread_seconds": round(one_thread_s, 3), f"in_process_{workers}_threads_seconds": round(threads_s, 3),
            "dask_cluster_start_seconds": round(start_s, 3), "dask_first_run_seconds": round(cold_s, 3),
            "dask_warm_run_seconds": round(warm_s, 3), "shard_overhead_seconds": round(warm_s - local_s, 3),
            "first_run_extra_seconds": round(cold_s - warm_s, 3), "speedup_warm": round(local_s / warm_s, 2),
            "labels_identical": bool(same), "workers": workers, "n_examples": len(rows), "n_tokens": one.n_tokens,
            "n_rollouts": int(one.meta["n_rollouts"]), "models": desc, "batch_size": batch_size,
            "max_new_tokens": max_new_tokens,
            "note": "one process (1 or `workers` torch threads) vs `workers` single-thread Dask workers, same cores"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="examples (default 50)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both methods (0: default)")
    ap.add_argument("--out", type=Path, default=None, help="default reports/bench_labels[_scale_out].json")
    ap.add_argument("--scale-out", action="store_true", help="the shard overhead on a local Dask cluster")
    ap.add_argument("--workers", type=int, default=2, help="--scale-out: Dask workers = in-process threads")
    a = ap.parse_args()
    started = time.perf_counter()
    out = (a.out or ROOT / "reports" / f"bench_labels{'_scale_out' if a.scale_out else ''}.json").resolve()
    if a.scale_out:
        res = scale_out(a.n, a.workers, a.batch_size, a.max_new_tokens)
    else:
        if a.threads > 0:
            torch.set_num_threads(a.threads)
        res = run(a.n, a.batch_size, a.max_new_tokens)
    write_json(out, res)
    stamp_bench(out, "labels", a, time.perf_counter() - started)
    for k, v in res.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
