"""Where the engine's time goes (``--profile``): torch.profiler over short engine runs at batch 1 and the largest
batch, GPU kernel time against wall time, and host syncs, copies and kernel launches per decoding step, stored in the
pair's ``profile`` entry."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_engines import shared_min_rows
from bench.gpu_pairs import BuiltPair
from bench.gpu_run import BenchRun
from citer.decoding.baselines import AlwaysSLM, RandomRouter
from citer.decoding.engine import RoutedEngine


def profile_engine(run: BenchRun, models: BuiltPair) -> None:
    """torch.profiler over short engine runs: GPU kernel time vs wall, host syncs, copies and launches per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    pair, slm, llm, vocab = models.name, models.slm, models.llm, models.vocab
    a = run.args
    n = a.profile_tokens
    big = max(a.batches)
    # The engine as the timed rows run it: its fixed-shape steps (--static-steps; CUDA graphs by default).
    kw0: dict[str, Any] = {"vocab_size": vocab, "static_steps": a.static_steps}
    route = {"tau": 0.5, **kw0}
    cases: list[tuple[str, int, RoutedEngine]] = [
        ("engine_slm", 1, RoutedEngine(slm, None, AlwaysSLM(), **kw0)),
        ("engine_llm", 1, RoutedEngine(llm, None, AlwaysSLM(), **kw0)),
        ("routed_f0.1", 1, RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), **route)),
        ("engine_slm", big, RoutedEngine(slm, None, AlwaysSLM(), **kw0)),
        ("routed_f0.1", big, RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), **route)),
    ]
    shared = {"llm_min_rows": shared_min_rows(a, big), "llm_max_wait_steps": a.max_wait_steps}
    if run.has_shared:
        cases.append(
            ("shared_f0.1", big, RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), **route, **shared))
        )
    if run.has_overlap and big > 1:  # is the GPU idle between the two models' graphs? (docs/gpu.md)
        cases.append(
            ("overlap_f0.1", big, RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), overlap=True, **route))
        )
        if run.has_shared:
            e = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), overlap=True, **route, **shared)
            cases.append(("overlap_shared_f0.1", big, e))
    out = {}
    for name, batch, e in cases:
        key = f"{name}_b{batch}"
        if run.left() < 30:
            run.note(f"profile {pair} {key}: skipped, time budget spent")
            continue
        prompts = run.prompts(vocab, batch, seed=batch)
        try:
            e.generate_batch(prompts, 4)
            wall, res = run.timed(lambda e=e, p=prompts: e.generate_batch(p, n))
            steps = getattr(res.batch, "decode_steps", 0) or n
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                pwall, _ = run.timed(lambda e=e, p=prompts: e.generate_batch(p, n))
            ev = prof.key_averages()
            dev_us = sum(_self_device_us(x) for x in ev if x.device_type == DeviceType.CUDA)
            counts = {x.key: x.count for x in ev}
            cpu_ops = [x for x in ev if x.device_type == DeviceType.CPU]
            cpu_top = sorted(cpu_ops, key=lambda x: x.self_cpu_time_total, reverse=True)[:12]
            names = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync",
                     "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "aten::copy_", "aten::index_put_",
                     "aten::index_select", "aten::nonzero")  # fmt: skip
            out[key] = {
                "batch": batch,
                "new_tokens": n,
                "decode_steps": steps,
                "static_steps": e.static_steps,
                "overlapped_steps": getattr(res.batch, "overlapped_steps", None),
                "wall_s": wall,
                "wall_ms_per_step": 1e3 * wall / steps,
                "wall_s_profiled": pwall,
                "gpu_kernel_ms_per_step": dev_us / 1e3 / steps,
                "gpu_busy_fraction": dev_us / 1e6 / wall,
                "per_step": {k: counts.get(k, 0) / steps for k in names},
                "top_self_cpu_ms_per_step": {
                    x.key: round(x.self_cpu_time_total / 1e3 / steps, 3) for x in cpu_top
                },
            }
            print(
                f"[{run.elapsed():6.1f}s] profile {pair} {key}: wall {1e3 * wall / steps:.2f} ms/step, "
                f"GPU kernels {dev_us / 1e3 / steps:.2f} ms/step ({100 * dev_us / 1e6 / wall:.0f}% busy); "
                f"per step {out[key]['per_step']}",
                flush=True,
            )
        except Exception as exc:
            run.error(f"profile {pair} {key}", exc)
    run.report["pairs"][pair]["profile"] = out
    run.save()


def _self_device_us(evt: Any) -> float:
    """An event's own GPU time in µs, under either attribute name (newer torch renamed self_cuda_time_total)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0
