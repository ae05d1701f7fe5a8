"""Time per generated token of SLM-only, LLM-only, routed and speculative decoding: ``python bench/engine.py``.

Two scales: ``embedded`` (the pipeline's own pair from ``models/`` when present, tiny random models otherwise) and
``memory_bound`` (random Qwen2-architecture models of ~30M and ~300M parameters, where reading weights rather than
Python overhead dominates a step). Routed rows use the random router at p = 0.1/0.3/0.5 and report the ratio of their
time per token to the ideal ``f * t_LLM + t_SLM`` (f = the measured LLM fraction, t at the same batch size), at
batch 1, 8 and 32; at batch > 1 also with shared LLM calls (``routed_shared``: a routed row waits for a quarter of
the batch, at most 4 steps), with the LLM calls per decoding step and the wait they add. Writes
``reports/bench_engine.json`` (atomically). Every row is timed twice in the same run, interleaved: with the HF
modules' forward (``forward: hf``) and with :mod:`citer.decoding.lean` (``forward: lean``, the engine's default for
the families it covers); lean routed rows carry ``vs_hf_forward``, their tokens/s over the HF forward's.
``--quick``: a < 1 minute smoke version with smaller models.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.random_models import prompts_for, random_qwen2  # noqa: E402
from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.decoding.kv_cache import RaggedKVCache, ragged_append  # noqa: E402
from citer.decoding.lean import forward_path, set_forward_path  # noqa: E402
from citer.ops.io import write_json  # noqa: E402
from citer.tracking.provenance import stamp_bench  # noqa: E402


def embedded_pair(quick: bool):
    from transformers import AutoModelForCausalLM

    models = ROOT / "models"
    slm_dir = next((d for d in (models / "slm", models / "slm_base") if (d / "config.json").is_file()), None)
    if not quick and slm_dir is not None and (models / "llm" / "config.json").is_file():
        slm = AutoModelForCausalLM.from_pretrained(slm_dir, dtype=torch.float32).eval()
        llm = AutoModelForCausalLM.from_pretrained(models / "llm", dtype=torch.float32).eval()
        return slm, llm, f"trained pair {slm_dir.relative_to(ROOT)} + {(models / 'llm').relative_to(ROOT)}"
    # Random weights: a 1-layer SLM and a 128 x 4 LLM (not citer.config.BootstrapParams' 2-layer SLM and 96 x 3 LLM).
    slm = random_qwen2(512, 32, 64, 1, 2, 1, seed=1)
    llm = random_qwen2(512, 128, 384, 4, 4, 2, seed=2)
    return slm, llm, "tiny random models (models/slm|slm_base and models/llm not found)"


def memory_bound_pair(quick: bool):
    if quick:
        return (
            random_qwen2(8000, 128, 384, 2, 4, 2, seed=1),
            random_qwen2(8000, 384, 1024, 6, 6, 2, seed=2),
            "random ~2M / ~20M (quick)",
        )
    slm = random_qwen2(32000, 384, 1024, 6, 6, 2, seed=1)
    llm = random_qwen2(32000, 1024, 2816, 20, 16, 4, seed=2)
    n = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (slm, llm)]
    return slm, llm, f"random Qwen2 {n[0]:.0f}M / {n[1]:.0f}M parameters, float32"


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_scale(
    scale, slm, llm, batches, new_tokens, repeats, speculative, profile, forwards=("lean",)
) -> list[dict]:
    """All methods at each batch size and forward path (``hf``: the HF modules; ``lean``: citer.decoding.lean);
    repeats are interleaved (round-robin over methods and paths) and the best kept, so drifting load on a shared
    machine biases every method alike."""
    vocab = slm.config.vocab_size
    rows: list[dict] = []
    for batch in batches:
        prompts = prompts_for(vocab, batch, seed=batch)
        engines = {}
        for fw in forwards:
            engines["slm", fw] = RoutedEngine(slm, llm, AlwaysSLM())
            engines["llm", fw] = RoutedEngine(slm, llm, AlwaysLLM())
            # Shared LLM calls: a routed row waits for a quarter of the batch (at most 4 steps); batch 1 has no one
            # to wait for.
            share = dict(llm_min_rows=max(2, batch // 4), llm_max_wait_steps=4)
            for p in (0.1, 0.3, 0.5):
                engines[p, False, fw] = RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5)
                if batch > 1 and p < 0.5:
                    engines[p, True, fw] = RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5, **share)
        best = {k: float("inf") for k in engines}
        res = {}
        for fw in forwards:
            use_forward((slm, llm), fw)
            engines["llm", fw].generate_batch(prompts, 2)  # warm-up (allocator, kernels, the lean view)
        for _ in range(repeats):
            for k, e in engines.items():
                use_forward((slm, llm), k[-1])
                sec, res[k] = timed(lambda e=e, p=prompts: e.generate_batch(p, new_tokens), 1)
                best[k] = min(best[k], sec)
        t = {k: best[k] / res[k].batch.new_tokens for k in engines}
        for k in engines:
            fw = k[-1]
            if isinstance(k[0], str):
                rows.append(dict(scale=scale, method=k[0], forward=fw, batch=batch, llm_fraction=res[k].batch.llm_fraction,
                                 sec_per_token=t[k], llm_calls_per_step=res[k].batch.llm_calls_per_step))  # fmt: skip
                continue
            p, shared, _ = k
            b = res[k].batch
            f = b.llm_fraction
            t_llm, t_slm = t["llm", fw], t["slm", fw]
            rows.append(dict(scale=scale, method="routed_shared" if shared else "routed", forward=fw, batch=batch,
                             llm_fraction=f, sec_per_token=t[k], ratio_to_ideal=t[k] / (f * t_llm + t_slm),
                             llm_calls_per_token=b.llm_calls_per_token, llm_calls_per_step=b.llm_calls_per_step,
                             wait_steps_per_llm_token=b.wait_steps_per_llm_token, p=p,
                             **({"llm_min_rows": max(2, batch // 4), "llm_max_wait_steps": 4} if shared else {}),
                             vs_llm_throughput=t_llm / t[k],
                             **({"vs_hf_forward": t[(p, shared, "hf")] / t[k]}
                                if fw != "hf" and (p, shared, "hf") in t else {})))  # fmt: skip
            if profile and batch == 1 and p == 0.3 and fw == forwards[-1]:
                prof = cProfile.Profile()
                use_forward((slm, llm), fw)
                prof.runcall(engines[k].generate_batch, prompts, new_tokens)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print(
                    f"--- cProfile, {scale}, routed p=0.3, batch 1 (sorted by own time) ---\n{s.getvalue()}"
                )
        if speculative and batch == 1:
            ids = torch.tensor(prompts)
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            llm.generate(ids, assistant_model=slm, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            sec, out = timed(lambda i=ids, k=kw: llm.generate(i, assistant_model=slm, **k), repeats)
            n_new = out.shape[1] - ids.shape[1]
            rows.append(dict(scale=scale, method="speculative", batch=batch, llm_fraction=None,
                             sec_per_token=sec / n_new))  # fmt: skip
    return rows


def use_forward(models, fw: str) -> None:
    """Pin the HF forward (``hf``) or let the lean one run (``lean``); refuse a lean row the models cannot take."""
    for m in models:
        set_forward_path(m, "hf" if fw == "hf" else "auto")
        if fw == "lean" and forward_path(m) != "lean":
            raise SystemExit(f"bench: lean forward requested but {forward_path(m)}")


def chunk_costs(model, context: int = 24, sizes=(1, 4, 10, 16)) -> dict[int, float]:
    """Seconds for one forward call feeding q new tokens of one row after ``context`` cached tokens: how far from
    the memory-bound ideal (cost independent of q) a catch-up call is on this machine."""
    out = {}
    for q in sizes:
        best = float("inf")
        for _ in range(3):
            cache = RaggedKVCache(model, 1, context + q)
            ragged_append(model, cache, [list(range(3, 3 + context))])
            t0 = time.perf_counter()
            ragged_append(model, cache, [list(range(5, 5 + q))])
            best = min(best, time.perf_counter() - t0)
        out[q] = best
    return out


def check_speculative_batch(slm, llm) -> str:
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    try:
        llm.generate(ids, assistant_model=slm, max_new_tokens=2, do_sample=False, pad_token_id=0)
        return "batch > 1 accepted"
    except Exception as exc:  # the reason HF gives, reported as is
        return f"batch > 1 refused: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 1 minute smoke version")
    ap.add_argument("--profile", action="store_true", help="cProfile a routed run at batch 1 per scale")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_engine.json"))
    # One thread by default: with 2 OpenMP threads on a shared 2-core machine, barrier waits swamp small ops.
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 on an idle machine)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; timings are wall-clock, noisy on a shared machine")
    rows: list[dict] = []
    with torch.inference_mode():
        slm, llm, desc = embedded_pair(args.quick)
        print(f"embedded: {desc}")
        print(f"speculative (HF assisted generation): {check_speculative_batch(slm, llm)}; reporting batch 1")
        emb = bench_scale("embedded", slm, llm, [1, 8, 32], 8 if args.quick else 48, 1 if args.quick else 3,
                          True, args.profile, forwards=("hf", "lean"))  # fmt: skip
        rows += [r | {"pair": desc} for r in emb]  # which pair each row ran on, never a silent fallback
        slm, llm, desc = memory_bound_pair(args.quick)
        print(f"memory_bound: {desc}")
        cc = chunk_costs(llm)
        print("memory_bound LLM, one call feeding q tokens (ms): "
              + ", ".join(f"q={q}: {1000 * v:.1f}" for q, v in cc.items()))  # fmt: skip
        mem = bench_scale("memory_bound", slm, llm, [1, 8, 32], 4 if args.quick else 32, 1 if args.quick else 2,
                          False, args.profile, forwards=("hf", "lean"))  # fmt: skip
        rows += [r | {"pair": desc} for r in mem]
    print(f"{'scale':<13}{'method':<14}{'fwd':>5}{'batch':>6}{'llm_frac':>9}{'ms/token':>10}{'ratio':>8}"
          f"{'llm/step':>9}{'wait/llm':>9}{'vs_hf':>7}")  # fmt: skip
    for r in rows:
        f = "" if r["llm_fraction"] is None else f"{r['llm_fraction']:.2f}"
        ratio = f"{r['ratio_to_ideal']:.2f}" if "ratio_to_ideal" in r else ""
        per_step = f"{r['llm_calls_per_step']:.2f}" if "llm_calls_per_step" in r else ""
        wait = f"{r['wait_steps_per_llm_token']:.2f}" if "wait_steps_per_llm_token" in r else ""
        vs_hf = f"{r['vs_hf_forward']:.2f}" if "vs_hf_forward" in r else ""
        print(f"{r['scale']:<13}{r['method']:<14}{r.get('forward', ''):>5}{r['batch']:>6}{f:>9}"
              f"{1000 * r['sec_per_token']:>10.2f}{ratio:>8}{per_step:>9}{wait:>9}{vs_hf:>7}")  # fmt: skip
    write_json(args.out, rows)
    stamp_bench(args.out, "engine", args, time.perf_counter() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
