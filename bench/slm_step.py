"""How near its bytes the SLM's decode step runs on this CPU, against llama.cpp's: ``python bench/slm_step.py``.

Issue #46 asks the SLM's step to take at most 1.5x its bytes time at batch 1 (2x at batch 8). Per batch, one process,
the pair's SLM alone at its real shape with random weights (seed 1) in ``--dtype`` (float32, the precision that wins
on an AVX2 EPYC; bf16 on an AVX512-BF16/AMX Xeon), timed in turn after a warm-up each:

- ``torch kernel`` / ``torch kernel, torch ops`` / ``torch packed`` / ``torch F.linear`` (float32): the engine
  ``citer route`` builds (``route_engine`` on the params' ``engine:`` block, the SLM alone) with
  ``citer.kernels.cpu_linear``'s float32 path in ``bench/cpu_linear.py``'s modes: the AVX2 kernel for calls of up to
  ``F32_MAX_ROWS`` rows and oneDNN's packed weight above, with the decode step's other ops in citer's C++
  (``citer.decoding.cpu_step``; the default on an AMD CPU) or in torch's ops; the packed weight for every call; and
  torch's ``F.linear``;
- ``torch kernel`` / ``torch kernel, torch ops`` / ``torch kernel, no AMX`` / ``torch F.linear`` (bf16): the same
  engine with the bf16 kernel (its AMX tiles for 2-32 rows where the CPU has them) and the step's C++ ops (the
  default), with torch's ops instead, without the AMX tiles (the vdpbf16ps blocks up to 4 rows, then oneDNN's packed
  weight), and torch's ``F.linear`` for every product;
- ``torch kernel, 4 KiB pages`` (both dtypes): the default decoder over a second copy of the SLM whose weights keep
  torch's allocations, where the default moves them onto huge pages (``citer.kernels.huge_pages``);
- ``llama.cpp <type>``: the same weights written to GGUF (F32 or BF16 as ``--dtype``, then llama.cpp's quantizer for
  the others), one sequence a row, the final norm's hidden state returned as the router needs it
  (``LlamaCppModel(hidden=True)``); skipped where llama-cpp-python is not importable.

``step_ms``: (``generate`` of ``--new-tokens`` tokens - ``generate`` of 1) / (tokens - 1), the medians of ``--reps``;
``bytes_ms``: the weights' bytes (torch: every parameter but an untied input embedding, as the cost meter counts
them; llama.cpp: the GGUF file) over the fastest large read this run measured (``read_bytes_per_s``; the rows' KV, a
few hundred kB, left out; the faster of two measurements, before and after the timed runs, ``read_passes``);
``x_bytes``: their ratio. The torch rows also carry the step's compute roof where the AVX2 kernel serves:
``compute_ms``, the step's multiply-adds (a weight element per row: batch x the float32 weights) at the kernel's
rate on a weight that stays in cache at that many rows (``kernel_macs_per_s``: no memory traffic, so the fastest its
products run here; the best of samples taken beside every rep, ``kernel_macs_samples``, since these shared cores'
speed drifts within a run), and ``x_roof`` = step / max(bytes, compute): a step can beat neither (float32 only: the
AMX tiles' products are far below the bytes time at these rows).

Writes ``reports/bench_slm_step_<cpu>.json`` (``--out``), stamped in ``reports/provenance.json``. Say whether the
machine was quiet: ``others_cpu_share`` is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from citer.ops.openmp import set_wait_env, wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import torch  # noqa: E402
from cpu_linear import MODES  # noqa: E402
from roofline import engine_block  # noqa: E402
from speed_report import (  # noqa: E402
    DTYPES,
    PAIRS,
    SPECS,
    build_model,
    cpu_times,
    others_cpu_share,
    read_bandwidth,
    write_report,
)

from citer.decoding.baselines import AlwaysSLM  # noqa: E402
from citer.decoding.cost import ModelCost  # noqa: E402
from citer.decoding.lean import lean_decoder  # noqa: E402
from citer.decoding.llama_cpp_runner import LlamaCppModel, missing  # noqa: E402
from citer.kernels import cpu_linear  # noqa: E402
from citer.models.to_gguf import quantize_gguf, write_gguf  # noqa: E402
from citer.serving.champion import route_engine  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402

# bench/cpu_linear.py's float32 modes (use_float32_packed's on, kernel) and the kernel without the step's C++ ops, as
# a decoder's name in the report -> use_float32_packed's (on, kernel, step_ops)
TORCH_MODES = {
    "torch kernel": (*MODES["kernel"], True),
    "torch kernel, torch ops": (*MODES["kernel"], False),
    "torch packed": (*MODES["packed"], True),
    "torch F.linear": (*MODES["torch"], True),
    "torch kernel, 4 KiB pages": (*MODES["kernel"], True),
}
# --dtype -> the GGUF type llama.cpp reads the same weights in (its quantizer's source)
GGUF_TYPE = {"fp32": "F32", "bf16": "BF16"}
# bf16: a decoder's name -> (cpu_linear's bf16 paths on, the AMX tiles, the step's C++ ops)
BF16_MODES = {
    "torch kernel": (True, True, True),
    "torch kernel, torch ops": (True, True, False),
    "torch kernel, no AMX": (True, False, True),
    "torch F.linear": (False, False, False),
    "torch kernel, 4 KiB pages": (True, True, True),
}
# the decoder whose SLM copy keeps torch's allocations (4 KiB pages) instead of the huge-page arena
SMALL_PAGES = "torch kernel, 4 KiB pages"


def set_mode(dtype: str, label: str) -> None:
    """Switch ``cpu_linear``'s paths to the decoder ``label`` of ``dtype``'s modes."""
    if dtype == "fp32":
        cpu_linear.use_float32_packed(*TORCH_MODES[label])
        return
    on, amx, step_ops = BF16_MODES[label]
    cpu_linear.use_bf16(on)
    cpu_linear.use_amx(amx)
    cpu_linear.use_step_ops(step_ops)


def reset_modes() -> None:
    """Every path back to its default."""
    cpu_linear.use_float32_packed(True)
    cpu_linear.use_bf16(True)
    cpu_linear.use_amx(True)
    cpu_linear.use_step_ops(True)


def llama_cpp_decode(model: LlamaCppModel, prompts: list[list[int]], n: int) -> None:
    """``n`` greedy tokens for every row: the prompts in one decode, then a decode a step."""
    model.reset()
    logits, _ = model.feed(dict(enumerate(prompts)))
    for _ in range(n - 1):
        logits, _ = model.feed({r: [int(t)] for r, t in enumerate(logits.argmax(-1))})


def kernel_macs_per_s(rows: int, reps: int = 200) -> float | None:
    """Multiply-adds a second of the AVX2 kernel at ``rows`` rows over a weight that stays in the cores' L2 caches
    (128 weight rows of 576 float32 a thread, at least 3 threads' worth: 0.3 MB a core, and every thread busy, as the
    kernel splits 16 blocks of 8 rows at least to a thread): the products' own speed, with no memory traffic; best
    of 5 passes of ``reps`` calls. None where the kernel does not serve (not built, or more rows than it takes)."""
    if not cpu_linear.f32_available() or rows > cpu_linear.F32_MAX_ROWS:
        return None
    w, x = torch.randn(128 * max(3, torch.get_num_threads()), 576), torch.randn(rows, 576)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(20):
            torch.ops.citer.linear_f32(x, w, None)
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                torch.ops.citer.linear_f32(x, w, None)
            best = min(best, (time.perf_counter() - t) / reps)
    return rows * w.numel() / best


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    spec = PAIRS[args.pair][0]
    vocab = SPECS[spec]["vocab"]
    slm = build_model(spec, "cpu", DTYPES[args.dtype], seed=1)
    modes = TORCH_MODES if args.dtype == "fp32" else BF16_MODES
    gguf_type = GGUF_TYPE[args.dtype]
    engine = route_engine(slm, None, AlwaysSLM(), 0.5, engine_block(Path(args.params)), vocab_size=vocab)
    slm_small_pages = build_model(spec, "cpu", DTYPES[args.dtype], seed=1)  # the same weights, another copy
    lean_decoder(slm_small_pages, rehome=False)  # built now, so the engine's first call finds it
    engines = {m: engine for m in modes} | {
        SMALL_PAGES: route_engine(
            slm_small_pages, None, AlwaysSLM(), 0.5, engine_block(Path(args.params)), vocab_size=vocab
        )
    }
    files: dict[str, Path] = {}
    why_not = missing() if args.llama_cpp_types else "no --llama-cpp-types"
    if why_not is None:
        full = scratch / f"slm-{gguf_type.lower()}.gguf"
        write_gguf(slm, full, gguf_type)
        for t in args.llama_cpp_types.split(","):
            files[t] = full if t == gguf_type else scratch / f"slm-{t.lower()}.gguf"
            if t != gguf_type:
                quantize_gguf(full, files[t], t)
    weight_bytes = {m: ModelCost.from_model(slm).weight_bytes for m in modes}
    weight_bytes |= {f"llama.cpp {t}": p.stat().st_size for t, p in files.items()}
    rows = []
    macs: dict[int, list[float]] = {}
    for b in (int(x) for x in args.batches.split(",")):
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, vocab, (b, args.prompt_len), generator=gen).tolist()
        runs: dict[str, Any] = {}
        macs[b] = []
        for label in modes:

            def torch_run(n: int, label: str = label, prompts: list[list[int]] = prompts) -> None:
                set_mode(args.dtype, label)
                engines[label].generate_batch(prompts, n)

            runs[label] = torch_run
        models = {t: LlamaCppModel(p, rows=b, row_tokens=args.prompt_len + args.new_tokens + 8, hidden=True)
                  for t, p in files.items()}  # fmt: skip
        for t, m in models.items():
            runs[f"llama.cpp {t}"] = lambda n, m=m, p=prompts: llama_cpp_decode(m, p, n)
        walls: dict[str, dict[int, list[float]]] = {k: {1: [], args.new_tokens: []} for k in runs}
        try:
            for run in runs.values():  # warm-up: kernels built, weights packed, contexts allocated
                run(2)
            for _ in range(args.reps):
                for k, run in runs.items():
                    for n in (1, args.new_tokens):
                        t = time.perf_counter()
                        run(n)
                        walls[k][n].append(time.perf_counter() - t)
                reset_modes()  # the kernel's own rate, whichever mode ran last
                rate = kernel_macs_per_s(b, reps=50) if args.dtype == "fp32" else None  # the roof (docstring)
                if rate is not None:
                    macs[b].append(rate)
        finally:
            for m in models.values():
                m.close()
            reset_modes()
        for k, w in walls.items():
            step = (statistics.median(w[args.new_tokens]) - statistics.median(w[1])) / (args.new_tokens - 1)
            rows.append({"batch": b, "decoder": k, "step_ms": step * 1e3, "weight_mb": weight_bytes[k] / 1e6,
                         "walls_s": w})  # fmt: skip
            print(f"b{b} {k}: {step * 1e3:.2f} ms a step", flush=True)
    return {
        "rows": rows,
        "llama_cpp_missing": why_not,
        "kernel_macs_samples": {str(b): v for b, v in macs.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--llama-cpp-types", default=None,
                    help="comma-separated; empty: torch only (default: F32 or BF16 as --dtype, Q8_0, Q4_0)")  # fmt: skip
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_slm_step.json"))
    args = ap.parse_args(argv)
    if args.llama_cpp_types is None:
        args.llama_cpp_types = GGUF_TYPE[args.dtype] + ",Q8_0,Q4_0"
    torch.manual_seed(0)
    t0 = cpu_times()
    batches = [int(x) for x in args.batches.split(",")]
    # The read before and after the timed runs, the faster kept: a roof measured in a slow spell of these shared
    # cores would flatter every ratio to it.
    reads = [read_bandwidth("cpu")]
    with tempfile.TemporaryDirectory(prefix="slm_step_") as scratch:
        got = measure(args, Path(scratch))
    reads.append(read_bandwidth("cpu"))
    read = max(reads, key=lambda r: r["best"])
    macs = {b: max(got["kernel_macs_samples"][str(b)], default=None) for b in batches}
    for row in got["rows"]:
        row["bytes_ms"] = row["weight_mb"] * 1e6 / read["best"] * 1e3
        row["x_bytes"] = row["step_ms"] / row["bytes_ms"]
        rate = macs[row["batch"]]
        if rate is not None and row["decoder"].startswith("torch"):
            row["compute_ms"] = row["batch"] * row["weight_mb"] * 1e6 / 4 / rate * 1e3
            row["x_roof"] = row["step_ms"] / max(row["bytes_ms"], row["compute_ms"])
    report = {
        "bench": "slm_step", "cpu": cpu_kind(), "threads": torch.get_num_threads(), "openmp": wait_env(),
        "torch": torch.__version__,
        "pair": args.pair, "slm": PAIRS[args.pair][0], "dtype": args.dtype, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "reps": args.reps, "f32_max_rows": cpu_linear.F32_MAX_ROWS,
        "bf16_amx": cpu_linear.amx() if args.dtype == "bf16" else None,
        "read_bytes_per_s": read, "kernel_macs_per_s": {str(b): r for b, r in macs.items()},
        "read_passes": [r["best"] for r in reads],
        "others_cpu_share": others_cpu_share(t0, cpu_times()), **got,
    }  # fmt: skip
    write_report(args.out, report, "slm_step", vars(args), time.time() - t0[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
