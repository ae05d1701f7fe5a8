"""Which float32 linear a decode step should call on this CPU: ``python bench/cpu_linear.py``.

A decode step's linears are products of a few rows with a weight read once from memory. Per weight shape (the
SmolLM2 pair's five matrices a layer and head, and the pipeline's embedded pair's, where a call's fixed cost shows)
and per row count, in one process, with cold weights (copies cycled past the caches):

- ``torch_ms``: torch's ``F.linear`` (MKL's SGEMM in torch's CPU wheels);
- ``packed_ms``: oneDNN's linear on the weight packed once (``torch.ops.mkldnn._linear_pointwise``);
- ``kernel_ms``: citer's AVX2 kernel (``torch.ops.citer.linear_f32``; up to ``F32_MAX_ROWS`` rows, where it builds);
- ``chosen``: which of them ``citer.kernels.cpu_linear.linear`` takes for that call on this CPU;
- ``torch_gb_s`` / ``packed_gb_s`` / ``kernel_gb_s``: the weight's bytes over the call's time (memory-bound calls near
  the bandwidth limit, which the run measures at its start as the fastest large read);
- ``row_invariant``: per kernel, whether row 0's outputs are bit for bit the same computed alone and beside the
  others (what lets regrouped calls keep a row's tokens);
- ``int8_bf16_ms`` (up to :data:`INT8_MAX_ROWS` rows) / ``int8_fp32_ms`` (one row): torch's own int8 weight-only
  CPU kernel (``torch.ops.aten._weight_int8pack_mm``, what torchao's int8 weight-only config runs), per-channel
  scales, with bf16 / float32 activations over int8 copies of the weight (a quarter of its float32 bytes): whether a
  torch runner in 8 bits would read the weights faster than float32 (issue #47 asks it measured).

``--engine 1,8`` also times, per batch, the engines ``citer route`` builds (``route_engine`` on the params'
``engine:`` block, as ``bench/roofline.py``: LLM alone, SLM alone, routed with a random router at f = 0.1) at the
SmolLM2 shapes in float32, with the float32 path on (kernel and packed weight), on without the kernel, and off, in
turn in one process (``engine_rows``: ``kernel_s``, ``packed_s``, ``torch_s``, the median of ``--reps`` after a warm-up
each; ``same_tokens``: whether the packed and torch runs wrote the kernel run's tokens, which random weights' near
ties need not).

Writes ``reports/bench_cpu_linear_<cpu>.json`` (``--out``; ``<cpu>`` a short name you give, e.g. ``zen3``), stamped
in ``reports/provenance.json``; docs/results.md renders it (block ``cpu_linear_<cpu>``). Say whether the machine was
quiet: ``others_cpu_share`` is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from citer.ops.openmp import set_wait_env, wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from speed_report import cpu_times, others_cpu_share, write_report  # noqa: E402

from citer.kernels import cpu_linear  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402

# (name, out, in): the matrices a decode step reads, fused as the lean forward fuses them.
SHAPES = [
    ("smollm2-1.7b qkv", 6144, 2048), ("smollm2-1.7b o", 2048, 2048), ("smollm2-1.7b gate+up", 16384, 2048),
    ("smollm2-1.7b down", 2048, 8192), ("smollm2-1.7b head", 49152, 2048),
    ("smollm2-135m qkv", 960, 576), ("smollm2-135m o", 576, 576), ("smollm2-135m gate+up", 3072, 576),
    ("smollm2-135m down", 576, 1536), ("smollm2-135m head", 49152, 576),
    ("embedded-llm gate+up", 576, 96), ("embedded-llm head", 512, 96), ("embedded-slm gate+up", 128, 32),
]  # fmt: skip
INT8_MAX_ROWS = 64  # above, the int8 kernel's dequantizing products are compute-bound and slow to time
QUICK_SHAPES = [("small", 96, 32), ("mid", 1024, 256)]
# The engine rows' float32 modes: name -> use_float32_packed's (on, kernel)
MODES = {"kernel": (True, True), "packed": (True, False), "torch": (False, False)}


def bandwidth_gb_s(mib: int = 256, reps: int = 5) -> float:
    """The fastest large read this process makes: a sum over ``mib`` MiB of float32, best of ``reps``."""
    a = torch.ones(mib * 2**20 // 4)
    best = min(_seconds(lambda: a.sum()) for _ in range(reps))
    return a.numel() * 4 / best / 1e9


def _seconds(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def time_calls(fn: Any, weights: list[torch.Tensor], reps: int) -> float:
    """Seconds a call, the median over ``reps`` passes through every (cold) weight, after one warm pass."""
    for w in weights[:2]:
        fn(w)
    per = [_seconds(lambda: [fn(w) for w in weights]) / len(weights) for _ in range(reps)]
    return statistics.median(per)


def measure(
    name: str, out: int, inp: int, rows_list: list[int], cold_mb: float, reps: int
) -> list[dict[str, Any]]:
    """Both kernels over copies of one (out, inp) float32 weight, each row count; see the module docstring."""
    n = max(2, min(256, int(cold_mb * 1e6 / (out * inp * 4))))
    gen = torch.Generator().manual_seed(out * 7 + inp)
    weights = [torch.randn(out, inp, generator=gen) for _ in range(n)]
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w) for w in weights}
    rows_out = []
    for rows in rows_list:
        x = torch.randn(rows, inp, generator=gen)

        def torch_call(w: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(x, w)

        def packed_call(w: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [], "")

        kernel = rows <= cpu_linear.F32_MAX_ROWS and cpu_linear.f32_available()

        def kernel_call(w: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
            return torch.ops.citer.linear_f32(x, w, None)

        with torch.inference_mode():
            t_torch = time_calls(torch_call, weights, reps)
            t_packed = time_calls(packed_call, weights, reps)
            t_kernel = time_calls(kernel_call, weights, reps) if kernel else None
            w = weights[0]
            chosen = cpu_linear.float32_path(x, w)  # the rule linear() follows
            invariant = {
                "torch": torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1]),
                "packed": torch.equal(packed_call(w, x[:1]), packed_call(w, x)[:1]),
            }
            if kernel:
                invariant["kernel"] = torch.equal(kernel_call(w, x[:1]), kernel_call(w, x)[:1])
        int8 = int8_times(weights, x, reps) if rows <= INT8_MAX_ROWS else {}
        gb = out * inp * 4 / 1e9
        rows_out.append({
            "shape": name, "out": out, "in": inp, "rows": rows, "torch_ms": t_torch * 1e3,
            "packed_ms": t_packed * 1e3, "torch_over_packed": t_torch / t_packed, "torch_gb_s": gb / t_torch,
            "packed_gb_s": gb / t_packed, "chosen": chosen, "row_invariant": invariant, **int8,
        })  # fmt: skip
        if t_kernel is not None:
            rows_out[-1] |= {"kernel_ms": t_kernel * 1e3, "kernel_gb_s": gb / t_kernel}
        r = rows_out[-1]
        print(f"{name} ({out}x{inp}) rows {rows}: torch {r['torch_ms']:.3f} ms, packed {r['packed_ms']:.3f} ms "
              f"({r['torch_over_packed']:.2f}x), kernel {r.get('kernel_ms')}, chosen {chosen}, int8 {int8}",
              flush=True)  # fmt: skip
    return rows_out


def int8_times(weights: list[torch.Tensor], x: torch.Tensor, reps: int) -> dict[str, float]:
    """torch's int8 weight-only kernel over int8 copies of ``weights`` (as many as make them cold: each a quarter of
    the float32 bytes): ms a call with bf16 activations, and with float32 ones at one row."""
    scales = [w.abs().amax(1).clamp_min(1e-12) / 127 for w in weights[:2]]
    q = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(weights[:2], scales, strict=True)]
    copies = [q[i % 2].clone() for i in range(4 * len(weights))]
    idx = {id(c): i % 2 for i, c in enumerate(copies)}
    out = {}
    for name, dtype in (("int8_bf16_ms", torch.bfloat16), ("int8_fp32_ms", torch.float32)):
        if dtype is torch.float32 and x.shape[0] > 1:
            continue
        xd, sd = x.to(dtype), [s.to(dtype) for s in scales]

        def call(c: torch.Tensor, xd: torch.Tensor = xd, sd: list[torch.Tensor] = sd) -> torch.Tensor:
            return torch.ops.aten._weight_int8pack_mm(xd, c, sd[idx[id(c)]])

        with torch.inference_mode():
            out[name] = time_calls(call, copies, reps) * 1e3
    return out


def engine_rows(
    batches: list[int], pair_name: str, params: Path, prompt_len: int, new_tokens: int, reps: int
) -> list[dict[str, Any]]:
    """Each engine at each batch with the float32 path on (kernel and packed), on without the kernel, and off, timed
    in turn (module docstring)."""
    from roofline import engine_block, engines, timed_in_turn
    from speed_report import build_pair

    pair = build_pair(pair_name, "cpu", "fp32")
    built = engines(pair, 0.1, engine_block(params))
    out = []
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(0, pair.vocab, (b, prompt_len), generator=gen).tolist()

        def run(e: Any, mode: str, prompts: list[list[int]] = prompts) -> Any:
            cpu_linear.use_float32_packed(*MODES[mode])
            return e.generate_batch(prompts, new_tokens).tokens

        fns = {(k, m): (lambda e=e, m=m: run(e, m)) for k, e in built.items() for m in MODES}
        try:
            got = timed_in_turn(fns, reps)
        finally:
            cpu_linear.use_float32_packed(True)
        for k in built:
            (kernel_s, kernel_tok), (packed_s, packed_tok), (torch_s, torch_tok) = (
                got[(k, m)] for m in MODES
            )
            out.append({"batch": b, "engine": k, "kernel_s": kernel_s, "packed_s": packed_s, "torch_s": torch_s,
                        "torch_over_packed": torch_s / packed_s, "packed_over_kernel": packed_s / kernel_s,
                        "same_tokens": packed_tok == torch_tok == kernel_tok})  # fmt: skip
            print(
                f"b{b} {k}: kernel {kernel_s:.2f} s, packed {packed_s:.2f} s, torch {torch_s:.2f} s",
                flush=True,
            )
    cpu_linear.use_float32_packed(True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--cold-mb", type=float, default=300.0, help="MB of weight copies cycled per shape")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="two small shapes, for a test")
    ap.add_argument(
        "--engine", default="", help="batches to time citer route's engines at, packed on and off"
    )
    ap.add_argument("--pair", default="smollm2", help="--engine: the pair (bench/speed_report.py PAIRS)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_cpu_linear.json"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    start, t0 = cpu_times(), time.perf_counter()
    rows_list = [int(x) for x in a.rows.split(",") if x]
    shapes = QUICK_SHAPES if a.quick else SHAPES
    bw = bandwidth_gb_s(16 if a.quick else 256)
    rows = [r for name, o, i in shapes for r in measure(name, o, i, rows_list, a.cold_mb, a.reps)]
    report = {
        "bench": "cpu_linear",
        "cpu": cpu_kind(),
        "threads": torch.get_num_threads(),
        "openmp": wait_env(),
        "torch": torch.__version__,
        "bandwidth_gb_s": bw,
        "fp32_packed_min": cpu_linear.FP32_PACKED_MIN,
        "fp32_packed_here": cpu_linear._fp32_packed(),
        "reps": a.reps,
        "cold_mb": a.cold_mb,
        "rows": rows,
        "engine_settings": {"pair": a.pair, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "f": 0.1},
        "engine_rows": engine_rows(
            [int(x) for x in a.engine.split(",") if x],
            a.pair,
            Path(a.params),
            a.prompt_len,
            a.new_tokens,
            a.reps,
        ),
        "others_cpu_share": others_cpu_share(start, cpu_times()),
    }
    write_report(a.out, report, "cpu_linear", a, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
