"""GPU bench of routed decoding at real shapes: ``python bench/gpu.py --out reports/bench_gpu.json``.

Needs only torch and transformers (and numpy, which both pull in): a GPU box may hold the ML stack without Prefect,
MLflow or DVC, so nothing here imports more than ``citer.decoding``.

Random-weight Qwen2 pairs at real shapes in bf16 (``0.5b-7b``: Qwen2-0.5B / Qwen2-7B; ``1.5b-14b``: Qwen2-1.5B /
Qwen2.5-14B), built directly on the GPU. Prompts are random token ids and there is no EOS, so every row generates
exactly ``--new-tokens``. Per pair and batch size (1, 8, 32), per generated token:

- ``hf_llm`` / ``hf_slm``: transformers ``generate`` (dynamic cache, eager); ``hf_llm_static_compiled`` /
  ``hf_slm_static_compiled`` (``--compile``): static cache, which makes ``generate`` compile the decode step with
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); compile time reported beside it;
- ``engine_llm`` / ``engine_slm``: our engine decoding with one model alone (``RoutedEngine(m, None, AlwaysSLM())``),
  as it now runs: the lean forward (:mod:`citer.decoding.lean`) and fixed-shape steps (``--static-steps``, CUDA graphs
  by default); the ``v0_`` variants are the same engine rows through the HF modules and ragged eager calls;
- ``routed_f{p}``: our engine, random router sending a token to the LLM with probability p = 0.05/0.1/0.3;
  ``routed_always_llm`` (batch 1): every token to the LLM (the SLM still runs every step);
- ``shared_f{p}`` (batch > 1): the same with shared LLM calls (``llm_min_rows``, ``llm_max_wait_steps``);
- ``overlap_f{p}`` / ``overlap_shared_f{p}`` (batch > 1, ``--overlap-fractions``): ``routed``/``shared`` with
  ``overlap=True`` -- the SLM's call queued while the LLM's catch-up is in flight (:mod:`citer.decoding.catch_up`);
- ``assisted_*`` (batch 1): transformers assisted generation (``generate(assistant_model=slm)``), constant draft
  length ``--draft-tokens``. Random models never agree, so besides natural acceptance (~0) a logits processor makes
  both models agree on a pseudo-random fraction ``alpha`` of positions (a hash of the prefix), giving a controlled
  acceptance rate.

Each time is the median of ``--reps`` interleaved runs after a warm-up, with ``torch.cuda.synchronize`` around each.
Ratios: ``ratio_to_ideal = t / (f * t_LLM + t_SLM)`` (t_LLM, t_SLM: ``engine_llm``/``engine_slm`` at the same batch,
f the measured LLM fraction) and ``ratio_to_bw = t / (bytes moved per token / bandwidth)`` (bytes as
:mod:`citer.decoding.cost` counts them; bandwidth 3.35 TB/s for an H100). Results are written after every
measurement (atomically), so a run stopped by a time limit still leaves what it measured. ``--tiny``: tiny models on
the CPU in float32, a seconds-long smoke run of every code path (its timings mean nothing).

Where it lives: ``bench/gpu_pairs.py`` (the model pairs), ``bench/gpu_timing.py`` (syncs, call and byte counts, the
host probe; per-token times, ratios and targets derived from the raw reps), ``bench/gpu_run.py`` (a run's state,
report and log), ``bench/gpu_engines.py`` (HF generate, the engine alone, routed and shared),
``bench/gpu_assisted.py`` (assisted generation and the agreement processor), ``bench/gpu_compiled.py`` (static cache
+ torch.compile), ``bench/gpu_profile.py`` (torch.profiler of the engine); this file runs them per pair and batch,
and holds the arguments and ``--recompute``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# A citer already on the path (PYTHONPATH: e.g. a pinned copy of one commit) wins over this checkout's.
if importlib.util.find_spec("citer") is None:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from citer.decoding.cost import GPU_BANDWIDTH  # noqa: E402

# The bench modules beside this file come from this checkout, put last on the path so that the citer imported above
# (and its submodules, which the bench modules import) stays the one found first.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.gpu_assisted import measure_assisted  # noqa: E402
from bench.gpu_compiled import measure_static_compiled  # noqa: E402
from bench.gpu_engines import measure_batch  # noqa: E402
from bench.gpu_pairs import PAIRS, BuiltPair, build_pair, n_params  # noqa: E402
from bench.gpu_profile import profile_engine  # noqa: E402
from bench.gpu_run import BenchRun  # noqa: E402
from bench.gpu_timing import derive_timings, sync, targets  # noqa: E402


class Bench(BenchRun):
    """A full run: per pair, the models built once, then every batch size, the profile and the compiled baseline."""

    def run_pair(self, pair: str) -> None:
        """Builds the pair's two models, records their sizes, then measures every batch size, the profile and the
        compiled baseline; frees the models after."""
        a = self.args
        slm_name, llm_name = PAIRS[pair]
        t = time.perf_counter()
        models = build_pair(pair, self.device, self.dtype)
        sync(self.device)
        build_s = time.perf_counter() - t
        slm_cost, llm_cost = models.costs
        self.report["pairs"][pair] = {
            "slm": slm_name,
            "llm": llm_name,
            "slm_params": n_params(models.slm),
            "llm_params": n_params(models.llm),
            "slm_weight_bytes_per_call": slm_cost.weight_bytes,
            "llm_weight_bytes_per_call": llm_cost.weight_bytes,
            "slm_kv_bytes_per_token": slm_cost.kv_bytes_per_token,
            "llm_kv_bytes_per_token": llm_cost.kv_bytes_per_token,
            "build_seconds": round(build_s, 1),
            "compile": {},
        }
        print(
            f"[{self.elapsed():6.1f}s] {pair}: {slm_name} {n_params(models.slm) / 1e9:.2f}B + {llm_name} "
            f"{n_params(models.llm) / 1e9:.2f}B params built in {build_s:.1f}s",
            flush=True,
        )
        self.save()
        try:
            with torch.inference_mode():
                for batch in a.batches:
                    if self.left() < 30:
                        self.note(f"{pair} batch {batch}: skipped, time budget spent")
                        continue
                    self.run_batch(models, batch)
                if a.profile and (a.tiny or self.left() > 60):  # --tiny: the profile's code path on the CPU
                    profile_engine(self, models)
                if a.compile and not a.tiny:
                    measure_static_compiled(self, models)
        finally:
            # The last reference to the models (the engines built on them were local to the measurements), so
            # their memory goes back before the next pair's.
            del models
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()

    def run_batch(self, models: BuiltPair, batch: int) -> None:
        """Every variant at ``batch`` (assisted at batch 1), added to the report and logged."""
        prompts = self.prompts(models.vocab, batch, seed=batch)
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # (B, P), equal lengths: no padding
        rows, t_tok = measure_batch(self, models, prompts, ids)
        if batch == 1 and self.args.assisted:
            rows += measure_assisted(self, models, ids, t_tok, rows)
        self.report["rows"] += rows
        self.save()
        self.print_rows(rows)

    def summarize(self) -> None:
        """Timings and ratios re-derived from the raw reps with ``--stat``, then the targets."""
        derive_timings(self.report, self.args.stat)
        self.report["targets"] = targets(self.report)
        self.save()

    def run(self) -> int:
        """Every pair of ``--pairs`` within the time budget, then the derived report; the exit code."""
        a = self.args
        print(f"device: {self.report['device']['name']}; torch {torch.__version__}; "
              f"transformers {self.report['transformers']}; shared LLM calls: {self.report['shared_llm_calls']}",
              flush=True)  # fmt: skip
        self.save()
        for pair in a.pairs:
            if self.left() < 60:
                self.note(f"{pair}: skipped, time budget spent")
                continue
            try:
                self.run_pair(pair)
            except Exception as exc:
                self.error(f"pair {pair}", exc)
            self.save()
        self.summarize()
        print(json.dumps(self.report["targets"], indent=1, default=float))
        print(f"wrote {a.out} in {self.elapsed():.0f}s")
        return 0


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="0.5b-7b,1.5b-14b", help=f"comma list of {sorted(PAIRS)}")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32])
    ap.add_argument(
        "--fractions", type=_floats, default=[0.05, 0.1, 0.3], help="random router LLM probabilities"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per variant (median reported)")
    ap.add_argument("--min-rows", type=int, default=0, help="shared: llm_min_rows (0: max(2, batch // 4))")
    ap.add_argument("--max-wait-steps", type=int, default=4, help="shared: llm_max_wait_steps")
    ap.add_argument(
        "--overlap-fractions",
        type=_floats,
        default=[0.1],
        help="overlap_f{p} / overlap_shared_f{p} (batch > 1): RoutedEngine(overlap=True); empty: none",
    )
    ap.add_argument(
        "--no-assisted", dest="assisted", action="store_false", help="skip HF assisted generation"
    )
    ap.add_argument("--draft-tokens", type=int, default=5, help="assisted: constant draft length")
    ap.add_argument("--assisted-tokens", type=int, default=32, help="assisted at natural acceptance: tokens")
    ap.add_argument(
        "--alphas", type=_floats, default=[0.9], help="assisted: forced agreement rates (besides 0)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="also HF generate with a static cache + torch.compile"
    )
    ap.add_argument("--compile-batches", type=_ints, default=[1, 8, 32])
    ap.add_argument(
        "--static-steps",
        default="auto",
        help="the engine's fixed-shape steps (citer.decoding.engine.STATIC_STEPS); auto: reduce-overhead (CUDA "
        "graphs) on a GPU, eager with --tiny",
    )
    ap.add_argument("--no-v0", dest="v0", action="store_false", help="skip the v0_ rows (the engine before)")
    ap.add_argument(
        "--compile-reserve", type=float, default=120, help="skip a compile with fewer seconds left"
    )
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler of the engine, batch 1 and the largest"
    )
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--compile-models", default="llm,slm", help="which models --compile runs")
    ap.add_argument("--gpu", default="H100", choices=sorted(GPU_BANDWIDTH), help="bandwidth for the limit")
    ap.add_argument("--time-budget", type=float, default=540, help="seconds; later measurements are skipped")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run of every path")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="warm-up run length (0: the full length, so "
        "per-shape setup such as cuDNN attention plans for every KV length stays out of the timings)",
    )
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="over the timed reps")
    ap.add_argument(
        "--recompute",
        default="",
        help="comma list of result files: merge, re-derive with --stat, write --out (no GPU needed)",
    )
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_gpu.json"))
    args = ap.parse_args(argv)
    args.pairs = [p for p in args.pairs.split(",") if p]
    if args.tiny:
        args.pairs = ["tiny"]
    bad = [p for p in args.pairs if p not in PAIRS]
    if bad:
        ap.error(f"unknown pairs {bad}; choose from {sorted(PAIRS)}")
    if args.static_steps == "auto":
        args.static_steps = "eager" if args.tiny else "reduce-overhead"
    if args.static_steps in ("none", ""):
        args.static_steps = None
    if not args.tiny and not args.recompute and not torch.cuda.is_available():
        ap.error("no CUDA device; use --tiny for a CPU smoke run")
    return args


def recompute(files: list[str], stat: str, out: str) -> int:
    """Merge result files (one device, e.g. one pair per device call) and re-derive timings and targets."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    merged = copy.deepcopy(reports[0])
    merged["runs"] = []
    for f, r in zip(files, reports, strict=True):
        run = {
            k: r.get(k) for k in ("device", "host", "citer", "torch", "transformers", "settings", "elapsed_s")
        }
        merged["runs"].append({"file": Path(f).name, **run})
        if r is reports[0]:
            continue
        if r["device"].get("name") != merged["device"].get("name"):
            raise SystemExit(
                f"{f}: device {r['device'].get('name')!r} differs from {merged['device'].get('name')!r}"
            )
        merged["pairs"].update(r["pairs"])
        merged["rows"] += r["rows"]
        merged["notes"] += r["notes"]
        merged["errors"] += r["errors"]
    derive_timings(merged, stat)
    merged["targets"] = targets(merged)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=float) + "\n")
    os.replace(tmp, out)
    print(json.dumps(merged["targets"], indent=1, default=float))
    print(f"wrote {out} ({len(merged['rows'])} rows, stat {stat})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recompute:
        return recompute([f for f in args.recompute.split(",") if f], args.stat, args.out)
    torch.manual_seed(0)
    return Bench(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
