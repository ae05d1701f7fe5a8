"""Routed decoding on llama.cpp's kernels against every LLM-only decoder llama.cpp offers, at each precision a CPU
user picks: ``python bench/llama_cpp_routed.py``.

The SmolLM2 pair's shapes (135M / 1.7B, Llama) with random weights (``bench/speed_report.py``), written as GGUF files
(``citer.models.to_gguf``, bf16) and quantized by llama.cpp's own quantizer to ``--quants``; at each precision and
batch, one process, llama.cpp through ``citer.decoding.llama_cpp_runner`` (one sequence id per row, llama.cpp's
defaults but for sizes and threads):

- ``llm_only``: the LLM alone (``solo_generate``), ``slm_only``: the SLM alone, its hidden states on (what routing
  pays for the router's input);
- ``routed``: both at that precision (``routed_generate``), a random router sending a fraction ``f`` of the tokens to
  the LLM (the SLM's hidden states read, the LLM catching up on the rows sent, in one call per step);
- ``routed_shared`` (batch > 1): the same with params.yaml's ``engine:`` call rule, as ``citer route`` runs it: a
  routed row leaves the SLM's batch and waits for others to share the LLM's call. Its ``routed_shared_agreement``
  is the share of its tokens equal to the at-once run's, position by position: sharing a call moves when a token
  arrives, never which, but llama.cpp's kernels are not batch-invariant (a decode of other rows and sizes may take
  another kernel, summing in another order), and random weights make near-ties everywhere, so a flip can happen;
- ``ideal_s``: ``slm_only`` + the seconds the routed run spent in the LLM: routing's step-time ideal (SLM step + f x
  catch-up), against which ``routed`` shows the glue's cost.

Every ratio is routed ÷ the fastest LLM-only decoder of the same run at any precision. Random prompt ids, no EOS,
the median of ``--reps`` after one warm-up. Writes ``reports/bench_cpu_llama_cpp_routed.json`` (``--out``), stamped
in ``reports/provenance.json``; docs/results.md renders it (``citer report docs``). ``others_cpu_share`` says whether
the machine was quiet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from citer.ops.openmp import set_wait_env, wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import numpy as np  # noqa: E402
import torch  # noqa: E402
from speed_report import (  # noqa: E402
    PAIRS,
    SPECS,
    build_model,
    cpu_times,
    cpu_vector,
    others_cpu_share,
    write_report,
)

from citer.config import load_params  # noqa: E402
from citer.decoding.baselines import RandomRouter  # noqa: E402
from citer.decoding.call_rule import CallRule, call_rule  # noqa: E402
from citer.decoding.llama_cpp_engine import routed_generate, solo_generate  # noqa: E402
from citer.decoding.llama_cpp_runner import LlamaCppModel, gguf_type_counts, missing  # noqa: E402
from citer.models.to_gguf import quantize_gguf, write_gguf  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402


def gguf_files(pair: str, quants: list[str], scratch: Path) -> dict[str, dict[str, Path]]:
    """``{precision: {"slm": path, "llm": path}}``: bf16 files written from the pair's random weights (seeds 1, 2),
    then llama.cpp's quantized copies; files already in ``scratch`` are reused."""
    out: dict[str, dict[str, Path]] = {"bf16": {}}
    for i, (which, spec) in enumerate(zip(("slm", "llm"), PAIRS[pair], strict=True)):
        path = scratch / f"{spec}-bf16.gguf"
        if not path.exists():
            model = build_model(spec, "cpu", torch.bfloat16, seed=i + 1)
            write_gguf(model, path, "BF16")
            del model
        out["bf16"][which] = path
    for q in quants:
        out[q.lower()] = {}
        for which, src in out["bf16"].items():
            dst = src.with_name(src.name.replace("-bf16", f"-{q.lower()}"))
            if not dst.exists():
                quantize_gguf(src, dst, q)
            out[q.lower()][which] = dst
    return out


def timed(fn: Any, reps: int) -> tuple[float, list[float], Any]:
    """One warm-up, then the median of ``reps`` wall seconds, the seconds, the last result."""
    fn()
    walls, res = [], None
    for _ in range(reps):
        t = time.perf_counter()
        res = fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), walls, res


def params_rule() -> CallRule:
    """The call rule of params.yaml's ``engine:`` block: what ``citer route`` decodes with."""
    e = load_params(ROOT / "params.yaml").engine
    return call_rule(e.llm_schedule, e.llm_min_rows, e.llm_max_wait_steps)


def measure_batch(files: dict[str, dict[str, Path]], batch: int, prompts: list[list[int]], new: int, f: float,
                  reps: int, rule: CallRule) -> list[dict[str, Any]]:  # fmt: skip
    """Every precision's LLM alone (and its prompt prefill), SLM alone, and routed pair at that precision (calling
    the LLM at once, and with ``rule`` at batch > 1); then the fastest SLM of the run paired with every other
    precision's LLM (the SLM's step and the LLM's compute need not be fastest at one precision)."""
    length = len(prompts[0]) + new + 8
    tokens = batch * new
    router = RandomRouter(f, seed=0)
    with contextlib.ExitStack() as stack:
        slms = {
            p: stack.enter_context(LlamaCppModel(fs["slm"], batch, length, hidden=True))
            for p, fs in files.items()
        }
        llms = {p: stack.enter_context(LlamaCppModel(fs["llm"], batch, length)) for p, fs in files.items()}
        alone: dict[str, dict[str, Any]] = {}
        for p in files:
            llm_s, llm_walls, _ = timed(partial(solo_generate, llms[p], prompts, new), reps)
            pre_s, _, _ = timed(partial(solo_generate, llms[p], prompts, 1), reps)
            slm_s, slm_walls, _ = timed(partial(solo_generate, slms[p], prompts, new), reps)
            alone[p] = {"llm_only_s": llm_s, "llm_only_walls": llm_walls, "llm_prefill_s": pre_s,
                        "llm_prompt_tok_s": batch * len(prompts[0]) / pre_s, "slm_only_s": slm_s,
                        "slm_only_walls": slm_walls, "llm_only_tok_s": tokens / llm_s, "slm_only_tok_s": tokens / slm_s}  # fmt: skip
        fastest_slm = min(alone, key=lambda p: alone[p]["slm_only_s"])
        pairs = [(p, p) for p in files] + [(fastest_slm, p) for p in files if p != fastest_slm]
        rows = []
        for sp, lp in pairs:
            routed_s, walls, run = timed(
                partial(routed_generate, slms[sp], llms[lp], prompts, router, 0.5, new), reps
            )
            shared: dict[str, Any] = {}
            if batch > 1:
                shared_s, shared_walls, srun = timed(
                    partial(routed_generate, slms[sp], llms[lp], prompts, router, 0.5, new, rule=rule), reps
                )
                same = sum(
                    x == y
                    for a, b in zip(srun.tokens, run.tokens, strict=True)
                    for x, y in zip(a, b, strict=True)
                )
                shared = {"routed_shared_s": shared_s, "routed_shared_walls": shared_walls,
                          "routed_shared_tok_s": tokens / shared_s, "routed_shared_llm_calls": srun.llm_calls,
                          "routed_shared_llm_fraction": srun.llm_fraction,
                          "routed_shared_agreement": same / max(1, sum(map(len, run.tokens)))}  # fmt: skip
            a, s = alone[lp], alone[sp]
            floor = s["slm_only_s"] + run.llm_tokens_read / a["llm_prompt_tok_s"]
            rows.append({
                "batch": batch, "precision": lp if sp == lp else f"slm {sp} + llm {lp}", "slm_precision": sp,
                "llm_precision": lp, **{k: v for k, v in a.items() if k.startswith("llm")},
                **{k: v for k, v in s.items() if k.startswith("slm")},
                "routed_s": routed_s, "routed_walls": walls, "routed_tok_s": tokens / routed_s,
                "routed_llm_fraction": run.llm_fraction, "routed_llm_calls": run.llm_calls,
                "routed_llm_tokens_read": run.llm_tokens_read, "routed_slm_s": run.slm_s, "routed_llm_s": run.llm_s,
                # routing's step-time ideal: the SLM alone plus the routed run's LLM calls
                "ideal_s": s["slm_only_s"] + run.llm_s, "routed_over_ideal": routed_s / (s["slm_only_s"] + run.llm_s),
                # the most routing can gain over this LLM alone: the SLM's decoding plus the LLM's compute over every
                # token it read (prompts and catch-ups) at its prompt rate, its fastest
                "ceiling_over_own_llm": a["llm_only_s"] / floor, "routed_over_own_llm": a["llm_only_s"] / routed_s,
                **shared,
            })  # fmt: skip
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch: the fastest LLM-only decoder at any precision, and each precision's routed speed over it."""
    out: dict[str, Any] = {}
    for b in sorted({r["batch"] for r in rows}):
        at = [r for r in rows if r["batch"] == b]
        best = max(at, key=lambda r: r["llm_only_tok_s"])
        out[f"b{b}_best_llm_only"] = f"llama.cpp {best['llm_precision']} ({best['llm_only_tok_s']:.2f} tok/s)"
        for r in at:
            out[f"b{b}_routed_{r['precision']}_over_best_llm_only"] = (
                r["routed_tok_s"] / best["llm_only_tok_s"]
            )
            if "routed_shared_tok_s" in r:
                out[f"b{b}_routed_shared_{r['precision']}_over_best_llm_only"] = (
                    r["routed_shared_tok_s"] / best["llm_only_tok_s"]
                )
        top = max(at, key=best_routed_tok_s)
        out[f"b{b}_best_routed"] = top["precision"]
        out[f"b{b}_best_routed_over_best_llm_only"] = best_routed_tok_s(top) / best["llm_only_tok_s"]
        out[f"b{b}_ceiling_over_best_llm_only"] = ceiling_over_best(at)
    return out


def best_routed_tok_s(row: dict[str, Any]) -> float:
    """A pair's routed tokens/s under the faster of its call rules (at once, the params' shared calls)."""
    return max(row["routed_tok_s"], row.get("routed_shared_tok_s", 0.0))


def ceiling_over_best(rows: list[dict[str, Any]]) -> float:
    """The most any pair of one batch's rows could gain over the fastest LLM-only decoder among them: each pair's
    ceiling (over its own LLM alone) rescaled to that decoder."""
    best = max(r["llm_only_tok_s"] for r in rows)
    return max(r["ceiling_over_own_llm"] * r["llm_only_tok_s"] / best for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    p.add_argument(
        "--quants", default="Q8_0,Q4_K_M,Q4_0", help="llama.cpp types beside bf16 (comma-separated)"
    )
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--f", type=float, default=0.1, help="the fraction of tokens the random router sends to the LLM"
    )
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--scratch", default="/tmp/citer_llama_cpp_routed", help="GGUF files, kept between runs")
    p.add_argument("--out", default=str(ROOT / "reports" / "bench_cpu_llama_cpp_routed.json"))
    a = p.parse_args(argv)
    if why := missing():
        print(f"llama_cpp_routed: {why}", file=sys.stderr)
        return 2
    quants = [q.strip() for q in a.quants.split(",") if q.strip()]
    batches = [int(b) for b in a.batches.split(",")]
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    files = gguf_files(a.pair, quants, scratch)
    vocab = min(SPECS[spec]["vocab"] for spec in PAIRS[a.pair])
    rule = params_rule()
    start = cpu_times()
    rows: list[dict[str, Any]] = []
    for b in batches:
        prompts = np.random.default_rng(0).integers(3, vocab, (b, a.prompt_len)).tolist()
        for r in measure_batch(files, b, prompts, a.new_tokens, a.f, a.reps, rule):
            rows.append(r)
            prec = r["precision"]
            print(f"b{b} {prec}: llm {r['llm_only_tok_s']:.2f} slm {r['slm_only_tok_s']:.1f} routed "
                  f"{r['routed_tok_s']:.2f} (shared {r.get('routed_shared_tok_s', 0):.2f}) tok/s "
                  f"(x{r['routed_over_own_llm']:.2f} own LLM, "
                  f"{r['routed_over_ideal']:.2f} of ideal)", flush=True)  # fmt: skip
    import llama_cpp

    report = {
        "bench": "llama_cpp_routed",
        "created_unix": int(time.time()),
        "device": {
            "cpu": cpu_kind(),
            "vector": cpu_vector(),
            "threads": torch.get_num_threads(),
            "openmp": wait_env(),
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        },  # fmt: skip
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "pair": a.pair,
            "quants": quants,
            "batches": batches,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "f": a.f,
            "reps": a.reps,
            "shared_call_rule": repr(rule),
        },  # fmt: skip
        "files": {
            prec: {w: {"bytes": p.stat().st_size, "tensor_types": gguf_type_counts(p)} for w, p in fs.items()}
            for prec, fs in files.items()
        },  # fmt: skip
        "rows": rows,
        "ratios": ratios(rows),
        "others_cpu_share": others_cpu_share(start, cpu_times()),
        "elapsed_s": round(time.time() - t0, 1),
    }
    write_report(a.out, report, "llama_cpp_routed", a, time.time() - t0)
    print(json.dumps(report["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
