"""How fast this CPU's matrix unit can run the LLM's prompt products, and how near oneDNN comes:
``python bench/amx_peak.py``.

Why: at batch 8 and 32 routing's ceiling (``bench/roofline.py``) is set by the LLM's compute over the prompts and
catch-ups it reads, which runs on oneDNN's packed weight (``citer.kernels.cpu_linear``, more than ``AMX_MAX_ROWS``
rows) and is compute-bound there. Whether a faster product could lift that ceiling is a question about the unit, so
this bench measures, in one process, on a CPU with AMX-BF16:

- ``tiles``: TDPBF16PS on tiles already loaded, four products a step into four 16 x 16 float32 sums (a 2 x 2 block:
  two 16 x 32 left tiles against two right ones): the unit alone, no operand moved;
- ``tiles_l1``: the same steps, each first loading its four operand tiles from L1 (1 KiB each; each load placed
  between products of the other tiles, so it can overlap them): what a product streaming its operands through L1
  can reach, since AMX's eight tiles allow no block that loads fewer tiles a product (four sums and four operands
  fill them);

  each on one thread and on as many threads as torch's pool at once (``tflops``);
- ``onednn``: oneDNN's linear on the packed weight over one layer of the pair's LLM (its four products, random bf16
  weights at its real shape) at each of ``--rows`` rows, TF/s, the same calls citer's prompts and catch-ups make;
  ``onednn_of_tiles_l1``: the median over reps of its rate over ``tiles_l1``'s on every thread in the same rep;
- ``citer``: at the ``--rows`` up to ``cpu_linear.AMX_MAX_ROWS``, the same layer through
  ``citer.kernels.cpu_linear.linear`` on the plain weight (citer's AMX tiles, the call a decode step, a short
  catch-up or prompt makes), and ``citer_over_onednn``: the median over reps of its rate over oneDNN's in the same rep.

Every run is timed in turn within a rep (``per_rep_tflops``): this host's matrix units have run at rates up to 4x
apart, reps apart, so only rates taken side by side make a ratio.

With ``--roofline`` (a ``bench/roofline.py`` report of the same CPU kind): per batch, the ceiling the routed pair
would have were the LLM's prompt rate 1 / ``onednn_of_tiles_l1`` (at the most rows measured) times the rate that
run measured, LLM-only's prompt sped up alike (its decode steps are bound by the weights' bytes, not by the products):
``ceiling_at_tiles_l1``, beside the run's own ``ceiling``. The scale is this run's ratio, read in one process; the
roofline's times are its own.

Writes ``reports/bench_amx_peak.json`` (``--out``), stamped in ``reports/provenance.json``. Say whether the machine
was quiet: ``others_cpu_share`` is recorded.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from citer.ops.openmp import set_wait_env, wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import torch  # noqa: E402
from speed_report import PAIRS, SPECS, cpu_times, others_cpu_share, write_report  # noqa: E402

from citer.kernels import cpu_linear  # noqa: E402
from citer.ops.cpu import host_cpu  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402

# Four TDPBF16PS a step on a 2 x 2 block (sums in tiles 0, 1, 5, 6; left operands 2, 3; right 4, 7), optionally
# loading the four operands from a 4 KiB buffer in L1 first; each thread its own tiles and buffer.
_SOURCE = r"""
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "cpu_amx.h"

namespace {
using citer_amx::TileConfig;

bool steps(int64_t n, bool loads) {
  alignas(64) uint16_t buf[4][512];
  for (auto& t : buf)
    for (auto& v : t) v = 0x3C00;  // bf16 1/128: sums stay finite
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  _tile_loadd(2, buf[0], 64);
  _tile_loadd(3, buf[1], 64);
  _tile_loadd(4, buf[2], 64);
  _tile_loadd(7, buf[3], 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(5);
  _tile_zero(6);
  for (int64_t i = 0; i < n; ++i) {
    if (loads) {  // each load between products of the other tiles, so it can overlap them
      _tile_loadd(2, buf[0], 64);
      _tile_loadd(4, buf[2], 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(7, buf[3], 64);
      _tile_dpbf16ps(5, 2, 7);
      _tile_loadd(3, buf[1], 64);
      _tile_dpbf16ps(1, 3, 4);
      _tile_dpbf16ps(6, 3, 7);
      continue;
    }
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    _tile_dpbf16ps(5, 2, 7);
    _tile_dpbf16ps(6, 3, 7);
  }
  alignas(64) float out[16][16];
  _tile_stored(0, out, 64);  // the sums leave the unit, so no step is dead code
  _tile_release();
  return out[0][0] == out[0][0];
}
}  // namespace

// Wall seconds of n steps on each of `threads` threads at once; -1 where the tiles cannot serve, -2 on a NaN sum.
extern "C" double citer_amx_steps(int64_t n, int loads, int threads) {
  if (!citer_amx::usable()) return -1.0;
  std::atomic<bool> ok{true};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> others;
  for (int i = 1; i < threads; ++i) others.emplace_back([&] { ok = steps(n, loads) && ok; });
  ok = steps(n, loads) && ok;
  for (auto& t : others) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok ? s : -2.0;
}
"""
FLOPS_PER_STEP = 4 * 16 * 16 * 32 * 2  # four products of 16 x 16 sums over 32 bf16 pairs' worth of columns


def build_steps(workdir: Path) -> Callable[[int, bool, int], float]:
    """``amx_steps(n, loads, threads)`` -> wall seconds, from ``_SOURCE`` built by the C++ compiler (``$CXX``, else
    ``c++``) into ``workdir`` and loaded with ctypes: no torch headers, so it builds in a second, not half a minute."""
    src, lib = workdir / "amx_steps.cpp", workdir / "amx_steps.so"
    src.write_text(_SOURCE)
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-mamx-tile", "-mamx-bf16", "-shared", "-fPIC",
           "-pthread", f"-I{ROOT / 'citer' / 'decoding'}", str(src), "-o", str(lib)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    fn = ctypes.CDLL(str(lib)).citer_amx_steps
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_int, ctypes.c_int]

    def amx_steps(n: int, loads: bool, threads: int) -> float:
        secs = fn(n, int(loads), threads)
        if secs < 0:
            raise RuntimeError("amx_steps: " + ("the tiles cannot serve here" if secs == -1 else "a NaN sum"))
        return secs

    return amx_steps


def layer_shapes(pair: str) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's four products of the pair's LLM: fused q/k/v, o, fused gate/up, down."""
    s = SPECS[PAIRS[pair][1]]
    head = s["hidden"] // s["heads"]
    return [
        ((s["heads"] + 2 * s["kv"]) * head, s["hidden"]),
        (s["hidden"], s["hidden"]),
        (2 * s["inter"], s["hidden"]),
        (s["hidden"], s["inter"]),
    ]


def timed_rates(amx_steps: Callable[[int, bool, int], float], n: int, shapes: list[tuple[int, int]], rows: list[int], reps: int,
                threads: int) -> dict[str, list[float]]:  # fmt: skip
    """TF/s per rep of the tile steps (alone and loading, one thread and all) and of oneDNN's layer at each row count,
    every one timed in turn within a rep: this host's matrix units run at rates up to 4x apart, reps apart, so a
    ratio is read between runs of one rep."""
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=torch.bfloat16) * 0.02 for o, i in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    macs = sum(o * i for o, i in shapes)
    runs: dict[str, tuple[Any, float]] = {}
    for name, loads in (("tiles", False), ("tiles_l1", True)):
        for where, t in (("one_thread", 1), ("all_threads", threads)):
            runs[f"{name} {where}"] = (
                lambda loads=loads, t=t: amx_steps(n, loads, t),
                FLOPS_PER_STEP * n * t,
            )

    def layer(product: Callable[[torch.Tensor, torch.Tensor], Any], operands: list[torch.Tensor],
              xs: dict[int, torch.Tensor]) -> Callable[[], float]:  # fmt: skip
        """Wall seconds of the layer's products, ``product(xs[in], operand)`` for each of its matrices."""

        def run() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                for (_, i), w in zip(shapes, operands, strict=True):
                    product(xs[i], w)
            return time.perf_counter() - t0

        return run

    def onednn(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    for m in rows:
        xs = {i: torch.randn(m, i, dtype=torch.bfloat16) for _, i in shapes}
        runs[f"onednn {m}"] = (layer(onednn, packed, xs), 2 * m * macs)
        if m <= cpu_linear.AMX_MAX_ROWS and cpu_linear.amx():
            runs[f"citer {m}"] = (layer(cpu_linear.linear, weights, xs), 2 * m * macs)
    for fn, _ in runs.values():  # warm-up: the tiles' state, the pool's threads, oneDNN's kernels
        fn()
    out: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, (fn, flops) in runs.items():
            out[k].append(flops / fn() / 1e12)
    return out


def same_rep_median(rates: list[float], others: list[float]) -> float:
    """The median over reps of ``rates`` over ``others`` taken in the same rep."""
    return statistics.median(a / b for a, b in zip(rates, others, strict=True))


def ceilings_at(roofline: dict[str, Any], scale: float) -> list[dict[str, Any]]:
    """Per batch of a roofline report: its ceiling, and the ceiling were the LLM's prompt rate ``scale`` times it."""
    out = []
    for r in roofline["rows"]:
        rate = r["llm_tokens_per_s_prefill"] * scale
        llm_s = r["llm_s"] - r["llm_prefill_s"] * (1 - 1 / scale)
        routed = r["slm_s"] + (r["routed_llm_prompt_tokens"] + r["routed_llm_catchup_tokens"]) / rate
        out.append({"batch": r["batch"], "ceiling": r["ceiling"], "ceiling_at_tiles_l1": llm_s / routed})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    ap.add_argument(
        "--rows", default="16,32,64,512,2048", help="rows of the layer's calls (a prompt's tokens, a batch's)"
    )
    ap.add_argument("--steps", type=int, default=2_000_000, help="tile steps a timed run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--roofline", default=None, help="a bench/roofline.py report to scale (same CPU kind)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_amx_peak.json"))
    args = ap.parse_args(argv)
    if not host_cpu().has("amx_tile", "amx_bf16"):
        print(
            f"bench/amx_peak.py: this CPU has no AMX-BF16 ({cpu_kind()}): nothing to measure", file=sys.stderr
        )
        return 2
    rows = [int(v) for v in args.rows.split(",") if v.strip()]
    if not rows or min(rows) < 1 or args.steps < 10 or args.reps < 1:
        ap.error("--rows: positive integers; --steps >= 10; --reps >= 1")
    roofline = json.loads(Path(args.roofline).read_text()) if args.roofline else None
    start, wall0 = cpu_times(), time.perf_counter()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        steps = build_steps(Path(tmp))
        per_rep = timed_rates(steps, args.steps, layer_shapes(args.pair), rows, args.reps, threads)
    tiles = {
        name: {
            where: statistics.median(per_rep[f"{name} {where}"]) for where in ("one_thread", "all_threads")
        }
        for name in ("tiles", "tiles_l1")
    }
    onednn = {str(m): statistics.median(per_rep[f"onednn {m}"]) for m in rows}
    bound = per_rep["tiles_l1 all_threads"]
    share = {str(m): same_rep_median(per_rep[f"onednn {m}"], bound) for m in rows}
    citer_rows = [m for m in rows if f"citer {m}" in per_rep]
    citer = {str(m): statistics.median(per_rep[f"citer {m}"]) for m in citer_rows}
    over = {str(m): same_rep_median(per_rep[f"citer {m}"], per_rep[f"onednn {m}"]) for m in citer_rows}
    report: dict[str, Any] = {
        "bench": "amx_peak",
        "cpu": cpu_kind(),
        "threads": threads,
        "openmp": wait_env(),
        "torch": torch.__version__,
        "pair": args.pair,
        "steps": args.steps,
        "reps": args.reps,
        "tflops": tiles,
        "onednn_tflops": onednn,
        "onednn_of_tiles_l1": share,
        "citer_tflops": citer,
        "citer_over_onednn": over,
        "per_rep_tflops": per_rep,
    }
    if roofline is not None:
        scale = 1 / share[str(max(rows))]
        report["roofline"] = {"report": args.roofline, "cpu": roofline.get("cpu"), "prompt_rate_scale": scale,
                              "rows": ceilings_at(roofline, scale)}  # fmt: skip
    report["others_cpu_share"] = others_cpu_share(start, cpu_times())
    write_report(args.out, report, "amx_peak", args, time.perf_counter() - wall0)
    for name, rates in tiles.items():
        print(f"{name}: {rates['one_thread']:.2f} TF/s a thread, {rates['all_threads']:.2f} on {threads}")
    for m, v in onednn.items():
        print(f"oneDNN packed, {m} rows: {v:.2f} TF/s, {share[m]:.0%} of tiles_l1 in the same rep")
    for m, v in citer.items():
        print(f"citer's tiles, {m} rows: {v:.2f} TF/s, {over[m]:.2f}x oneDNN's in the same rep")
    for r in report.get("roofline", {}).get("rows", []):
        print(
            f"batch {r['batch']}: ceiling {r['ceiling']:.2f}x, at tiles_l1's rate {r['ceiling_at_tiles_l1']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
