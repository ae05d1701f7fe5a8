"""Routed decoding of the engine today against the engine at an earlier commit: ``python bench/engine_v0.py``.

Issue #22 asks for routed tokens/s on the embedded pair at batch 1 and 32 of at least 2x "today's" -- the engine as it
was when the issue was filed (``--base``, default 644bb89, the last commit before the issue's work). That engine is
taken from git (``git archive <base> citer``) into a temporary directory and timed in its own process, alternating
with this checkout's engine over ``--rounds`` rounds (best round kept), on the same pair, prompts and random router
(p = 0.1, ``tau`` 0.5), one torch thread. The pair is the pipeline's trained pair from ``models/`` (run ``citer
pipeline`` first); ``--random`` uses random weights of the bootstrap architectures instead. ``today_compiled`` is
this checkout with the compiled lean forward (:mod:`citer.decoding.compiled`; ``--no-compiled`` skips it): its
compile runs in warm-up generations outside the timing and is reported as ``warmup_s``. Writes
``reports/bench_engine_v0.json`` (atomically): one row per (engine, batch) and the ratio of each of this checkout's
engines over the base per batch (``b{B}_today_over_base_tokens_per_s``, ``b{B}_compiled_over_base_tokens_per_s``).
``today_overlap`` is this checkout with overlapped steps (``RoutedEngine(overlap=True)``; ``--no-overlap`` skips it),
whose ratio to ``today`` (``b{B}_overlap_over_today_tokens_per_s``) says what overlapping costs on a device that
runs one call at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Timed in a child process whose sys.path starts at one engine's copy; it prints one JSON line.
CHILD = r"""
import json, sys, time, torch
sys.path[:0] = [sys.argv[1], sys.argv[6]]  # that engine's citer first, then this checkout's bench helpers
from bench.random_models import prompts_for, random_qwen2
from citer.decoding.baselines import RandomRouter
from citer.decoding.engine import RoutedEngine
from transformers import AutoModelForCausalLM

models, batches, new_tokens, repeats = sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
mode = sys.argv[7]  # plain | compiled | overlap
compiled = mode == "compiled"
torch.set_num_threads(1)
with torch.inference_mode():
    if models == "random":
        slm, llm, vocab = random_qwen2(512, 32, 64, 2, 2, 1, 1), random_qwen2(512, 96, 288, 3, 4, 2, 2), 512
    else:
        slm = AutoModelForCausalLM.from_pretrained(models + "/slm", dtype=torch.float32).eval()
        llm = AutoModelForCausalLM.from_pretrained(models + "/llm", dtype=torch.float32).eval()
        from transformers import AutoTokenizer
        vocab = len(AutoTokenizer.from_pretrained(models + "/slm"))
    if compiled:
        from citer.decoding.lean import set_forward_path
        for m in (slm, llm):
            set_forward_path(m, "compiled")
    out = {}
    for b in batches:
        prompts = prompts_for(vocab, b, seed=b)
        extra = {"overlap": True} if mode == "overlap" else {}  # an older engine has no such argument
        eng = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), tau=0.5, **extra)
        t = time.perf_counter()
        eng.generate_batch(prompts, 2)  # warm-up
        if compiled:  # every graph kind at its first and a second size (citer.decoding.compiled), outside the timing
            for _ in range(2):
                eng.generate_batch(prompts, new_tokens)
        warmup = time.perf_counter() - t
        best, res = float("inf"), None
        for _ in range(repeats):
            t = time.perf_counter()
            res = eng.generate_batch(prompts, new_tokens)
            best = min(best, time.perf_counter() - t)
        out[b] = {"sec_per_token": best / res.batch.new_tokens, "llm_fraction": res.batch.llm_fraction,
                  "warmup_s": warmup}
print(json.dumps(out))
"""


def time_engine(
    src: Path, models: str, batches: list[int], new_tokens: int, repeats: int, mode: str = "plain"
) -> dict[int, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [
        sys.executable,
        "-c",
        CHILD,
        str(src),
        models,
        ",".join(map(str, batches)),
        str(new_tokens),
        str(repeats),
        str(ROOT),
        mode,
    ]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=src, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench: the engine at {src} failed:\n{proc.stderr[-2000:]}")
    return {int(b): v for b, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> int:
    from citer.ops.io import write_json
    from citer.tracking.provenance import stamp_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="644bb89", help="the engine to compare with (a git commit)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per round, best kept")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two engines")
    ap.add_argument("--random", action="store_true", help="random weights instead of models/")
    ap.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time this checkout with the compiled lean forward (citer.decoding.compiled)",
    )
    ap.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time this checkout with overlapped steps (RoutedEngine(overlap=True), citer.decoding.catch_up)",
    )
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_engine_v0.json"))
    args = ap.parse_args(argv)
    started = time.perf_counter()
    models = "random" if args.random else str(ROOT / "models")
    if not args.random and not (ROOT / "models" / "slm" / "config.json").is_file():
        raise SystemExit("bench: models/slm not found; run `citer pipeline` first or pass --random")
    batches = [int(b) for b in args.batches.split(",")]
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    best: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", base, "citer"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for r in range(args.rounds):
            # Alternate which engine goes first, so drifting load biases neither.
            order = [("base", Path(tmp), "plain"), ("today", ROOT, "plain")]
            if args.compiled:
                order.append(("today_compiled", ROOT, "compiled"))
            if args.overlap:
                order.append(("today_overlap", ROOT, "overlap"))
            if r % 2:
                order.reverse()
            for name, src, mode in order:
                for b, v in time_engine(src, models, batches, args.new_tokens, args.repeats, mode).items():
                    if (name, b) not in best or v["sec_per_token"] < best[name, b]["sec_per_token"]:
                        best[name, b] = v
    engines = ["base", "today"] + (["today_compiled"] if args.compiled else [])
    engines += ["today_overlap"] if args.overlap else []
    rows = [
        {"engine": name, "commit": base if name == "base" else "working tree", "batch": b, "p": 0.1,
         "pair": "random bootstrap architectures" if args.random else "trained pair models/slm + models/llm",
         **best[name, b]}
        for name in engines for b in batches
    ]  # fmt: skip
    ratios = {f"b{b}_{name.replace('today_', '')}_over_base_tokens_per_s":
              best["base", b]["sec_per_token"] / best[name, b]["sec_per_token"]
              for name in engines[1:] for b in batches}  # fmt: skip
    if args.overlap:  # what overlapping costs or gains over the same engine's sequential steps, here
        ratios |= {f"b{b}_overlap_over_today_tokens_per_s":
                   best["today", b]["sec_per_token"] / best["today_overlap", b]["sec_per_token"]
                   for b in batches}  # fmt: skip
    for b in batches:
        line = f"batch {b:>3}: base {1000 * best['base', b]['sec_per_token']:.4f} ms/token"
        for name in engines[1:]:
            r = ratios[f"b{b}_{name.replace('today_', '')}_over_base_tokens_per_s"]
            line += f", {name} {1000 * best[name, b]['sec_per_token']:.4f} ({r:.2f}x)"
        print(line)
    write_json(args.out, {"base": base, "rows": rows, "ratios": ratios})
    stamp_bench(args.out, "engine_v0", args, time.perf_counter() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
