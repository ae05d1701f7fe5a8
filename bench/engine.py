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
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.decoding.kv_cache import RaggedKVCache, ragged_append  # noqa: E402
from citer.decoding.lean import forward_path, set_forward_path  # noqa: E402
from citer.ops.io import write_json  # noqa: E402
from citer.tracking.provenance import stamp_bench  # noqa: E402


def random_qwen2(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def prompts_for(vocab: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of mixed lengths (12..24 tokens), ids in [3, vocab), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(12, 25, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def embedded_pair(quick: bool):
    from transformers import AutoModelForCausalLM

    models = ROOT / "models"
    slm_dir = next((d for d in (models / "slm", models / "slm_base") if (d / "config.json").is_file()), None)
    if not quick and slm_dir is not None and (models / "llm" / "config.json").is_file():
        slm, llm = (
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for d in (slm_dir, models / "llm")
        )
        return slm, llm, f"trained pair {slm_dir.relative_to(ROOT)} + models/llm"  # fmt: skip
    # Random weights: a 1-layer SLM and a 128 x 4 LLM (not citer.config.BootstrapParams' 2-layer SLM and 96 x 3 LLM).
    slm, llm = random_qwen2(512, 32, 64, 1, 2, 1, seed=1), random_qwen2(512, 128, 384, 4, 4, 2, seed=2)
    return slm, llm, "tiny random models (models/slm|slm_base and models/llm not found)"


def memory_bound_pair(quick: bool):
    if quick:
        slm, llm = (
            random_qwen2(8000, 128, 384, 2, 4, 2, seed=1),
            random_qwen2(8000, 384, 1024, 6, 6, 2, seed=2),
        )
        return slm, llm, "random ~2M / ~20M (quick)"
    slm = random_qwen2(32000, 384, 1024, 6, 6, 2, seed=1)
    llm = random_qwen2(32000, 1024, 2816, 20, 16, 4, seed=2)
    n = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (slm, llm)]
    return slm, llm, f"random Qwen2 {n[0]:.0f}M / {n[1]:.0f}M parameters, float32"


def bench_scale(scale, slm, llm, batches, new_tokens, repeats, speculative, forwards=("lean",)) -> list[dict]:
    """All methods at each batch size and forward path (``hf``: the HF modules; ``lean``: citer.decoding.lean);
    repeats are interleaved (round-robin over methods and paths) and the best kept, so drifting load on a shared
    machine biases every method alike."""  # fmt: skip
    rows: list[dict] = []
    for batch in batches:
        prompts = prompts_for(slm.config.vocab_size, batch, seed=batch)
        # Shared LLM calls: a routed row waits for a quarter of the batch (at most 4 steps); batch 1 has no one to
        # wait for.
        share = dict(llm_min_rows=max(2, batch // 4), llm_max_wait_steps=4)
        engines = {}
        for fw in forwards:
            engines["slm", fw] = RoutedEngine(slm, llm, AlwaysSLM())
            engines["llm", fw] = RoutedEngine(slm, llm, AlwaysLLM())
            for p in (0.1, 0.3, 0.5):
                engines[p, False, fw] = RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5)
                if batch > 1 and p < 0.5:
                    engines[p, True, fw] = RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5, **share)
        for fw in forwards:
            use_forward((slm, llm), fw)
            engines["llm", fw].generate_batch(prompts, 2)  # warm-up (allocator, kernels, the lean view)
        best, res = {k: float("inf") for k in engines}, {}
        for _ in range(repeats):
            for k, e in engines.items():
                use_forward((slm, llm), k[-1])
                t0 = time.perf_counter()
                res[k] = e.generate_batch(prompts, new_tokens)
                best[k] = min(best[k], time.perf_counter() - t0)
        t = {k: best[k] / res[k].batch.new_tokens for k in engines}
        for k in engines:
            b, fw = res[k].batch, k[-1]
            row = dict(scale=scale, forward=fw, batch=batch, llm_fraction=b.llm_fraction, sec_per_token=t[k])
            if isinstance(k[0], str):
                rows.append(row | dict(method=k[0], llm_calls_per_step=b.llm_calls_per_step))
                continue
            p, shared, _ = k
            rows.append(row | dict(method="routed_shared" if shared else "routed",
                                   ratio_to_ideal=t[k] / (b.llm_fraction * t["llm", fw] + t["slm", fw]),
                                   llm_calls_per_token=b.llm_calls_per_token, llm_calls_per_step=b.llm_calls_per_step,
                                   wait_steps_per_llm_token=b.wait_steps_per_llm_token, p=p,
                                   **({"llm_min_rows": share["llm_min_rows"], "llm_max_wait_steps": 4} if shared else {}),
                                   vs_llm_throughput=t["llm", fw] / t[k],
                                   **({"vs_hf_forward": t[(p, shared, "hf")] / t[k]}
                                      if fw != "hf" and (p, shared, "hf") in t else {})))  # fmt: skip
        if speculative and batch == 1:  # HF assisted generation takes one row at a time
            ids = torch.tensor(prompts)
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            llm.generate(ids, assistant_model=slm, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
            sec = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = llm.generate(ids, assistant_model=slm, **kw)
                sec = min(sec, time.perf_counter() - t0)
            rows.append(dict(scale=scale, method="speculative", batch=batch, llm_fraction=None,
                             sec_per_token=sec / (out.shape[1] - ids.shape[1])))  # fmt: skip
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
        out[q] = float("inf")
        for _ in range(3):
            cache = RaggedKVCache(model, 1, context + q)
            ragged_append(model, cache, [list(range(3, 3 + context))])
            t0 = time.perf_counter()
            ragged_append(model, cache, [list(range(5, 5 + q))])
            out[q] = min(out[q], time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 1 minute smoke version")
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
        emb = bench_scale("embedded", slm, llm, [1, 8, 32], 8 if args.quick else 48, 1 if args.quick else 3,
                          True, forwards=("hf", "lean"))  # fmt: skip
        rows += [r | {"pair": desc} for r in emb]  # which pair each row ran on, never a silent fallback
        slm, llm, desc = memory_bound_pair(args.quick)
        print(f"memory_bound: {desc}")
        print("memory_bound LLM, one call feeding q tokens (ms): "
              + ", ".join(f"q={q}: {1000 * v:.1f}" for q, v in chunk_costs(llm).items()))  # fmt: skip
        mem = bench_scale("memory_bound", slm, llm, [1, 8, 32], 4 if args.quick else 32, 1 if args.quick else 2,
                          False, forwards=("hf", "lean"))  # fmt: skip
        rows += [r | {"pair": desc} for r in mem]
    cols = {"llm_fraction": ("llm_frac", 9, 1), "sec_per_token": ("ms/token", 10, 1000), "ratio_to_ideal": ("ratio", 8, 1),
            "llm_calls_per_step": ("llm/step", 9, 1), "wait_steps_per_llm_token": ("wait/llm", 9, 1),
            "vs_hf_forward": ("vs_hf", 7, 1)}  # fmt: skip
    print(
        f"{'scale':<13}{'method':<14}{'fwd':>5}{'batch':>6}"
        + "".join(f"{h:>{w}}" for h, w, _ in cols.values())
    )
    for r in rows:
        cells = ("" if r.get(c) is None else f"{x * r[c]:.2f}" for c, (_, _, x) in cols.items())
        print(f"{r['scale']:<13}{r['method']:<14}{r.get('forward', ''):>5}{r['batch']:>6}"
              + "".join(f"{v:>{w}}" for v, (_, w, _) in zip(cells, cols.values(), strict=True)))  # fmt: skip
    write_json(args.out, rows)
    stamp_bench(args.out, "engine", args, time.perf_counter() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
