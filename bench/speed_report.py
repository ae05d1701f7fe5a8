"""What ``bench/speed.py`` measures on and what it derives: the model pairs (random weights at real shapes), bytes moved
and the bandwidth limit, a run's report (written atomically after every measurement) and its log, per-token times,
ratios to the bandwidth limit and to the ideal, the targets, and the plan's time estimate.

Needs only torch and transformers (and numpy): a GPU machine may hold the ML stack without Prefect, MLflow or DVC.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from citer.decoding.cost import GPU_BANDWIDTH, ModelCost
from citer.ops.cpu import host_cpu
from citer.ops.io import write_text
from citer.ops.openmp import wait_env

# ----------------------------------------------------------------------------------------------------------- models
# Real configs (family, hidden, intermediate, layers, heads, kv heads, vocab rows, tied embeddings, max positions).
# fmt: off
SPECS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(family="qwen2", hidden=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tie=True),
    "qwen2-1.5b": dict(family="qwen2", hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tie=True),
    "qwen2-7b": dict(family="qwen2", hidden=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tie=False),
    "qwen2.5-14b": dict(family="qwen2", hidden=5120, inter=13824, layers=48, heads=40, kv=8, vocab=152064, tie=False),
    # SmolLM2 (Llama architecture, one tokenizer of 49,152 ids, tied embeddings): the CPU pair, LLM/SLM ~12.6x.
    "smollm2-135m": dict(family="llama", hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152, tie=True),
    "smollm2-1.7b": dict(family="llama", hidden=2048, inter=8192, layers=24, heads=32, kv=32, vocab=49152, tie=True),
    # The pipeline's embedded pair (citer.config BootstrapParams' defaults): Python-bound, where the lean forward and
    # the engine's bookkeeping show (``--hf-forward`` times the same engines through the HF modules).
    "embedded-slm": dict(family="qwen2", hidden=32, inter=64, layers=2, heads=2, kv=1, vocab=512, tie=True),
    "embedded-llm": dict(family="qwen2", hidden=96, inter=288, layers=3, heads=4, kv=2, vocab=512, tie=True),
    # --tiny: the same structure (GQA, a tied SLM head, different vocab rows), seconds on a CPU.
    "tiny-slm": dict(family="qwen2", hidden=32, inter=64, layers=2, heads=4, kv=2, vocab=512, tie=True),
    "tiny-llm": dict(family="qwen2", hidden=64, inter=128, layers=3, heads=4, kv=2, vocab=520, tie=False),
    # --tiny --pairs tiny-llama: the SmolLM2 pair's structure in seconds (Llama, tied heads, one vocab; the SLM's rows
    # of 96 fit no 256-wide K-quant block, the LLM's 256 do), for the llama.cpp peer's paths.
    "tiny-llama-slm": dict(family="llama", hidden=96, inter=192, layers=2, heads=4, kv=2, vocab=512, tie=True),
    "tiny-llama-llm": dict(family="llama", hidden=256, inter=512, layers=2, heads=4, kv=4, vocab=512, tie=True),
}
# fmt: on
# Pair name -> (SLM spec, LLM spec).
PAIRS: dict[str, tuple[str, str]] = {
    "0.5b-7b": ("qwen2-0.5b", "qwen2-7b"),
    "1.5b-14b": ("qwen2-1.5b", "qwen2.5-14b"),
    "smollm2": ("smollm2-135m", "smollm2-1.7b"),
    "embedded": ("embedded-slm", "embedded-llm"),
    "tiny": ("tiny-slm", "tiny-llm"),
    "tiny-llama": ("tiny-llama-slm", "tiny-llama-llm"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_model(name: str, device: str, dtype: torch.dtype, seed: int) -> Any:
    """A random-weight causal LM of spec ``name``, built on ``device`` in ``dtype`` (no CPU detour on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s = SPECS[name]
    common = dict(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"], tie_word_embeddings=s["tie"],
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    if s["family"] == "llama":
        cfg, cls = LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, **common), LlamaForCausalLM
    else:
        cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, use_sliding_window=False, **common)
        cls = Qwen2ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, 0
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    model.config._name_or_path = name
    return model


def n_params(model: Any) -> int:
    """Parameters of ``model``, a tied embedding counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass
class BuiltPair:
    """A pair's two models on the device in one dtype, with what every measurement of them needs."""

    name: str  # the PAIRS key, e.g. "0.5b-7b"
    dtype: str  # "bf16" or "fp32"
    slm: Any
    llm: Any
    costs: tuple[ModelCost, ModelCost]  # (SLM, LLM): weight bytes per call, KV bytes per token
    vocab: int  # ids both models have rows for (the larger vocab's extra rows are masked in generation)


def build_pair(name: str, device: str, dtype: str) -> BuiltPair:
    """Pair ``name``'s SLM (seed 1) and LLM (seed 2), built on ``device`` in ``dtype``."""
    slm_name, llm_name = PAIRS[name]
    slm = build_model(slm_name, device, DTYPES[dtype], seed=1)
    llm = build_model(llm_name, device, DTYPES[dtype], seed=2)
    costs = (ModelCost.from_model(slm), ModelCost.from_model(llm))
    vocab = min(SPECS[slm_name]["vocab"], SPECS[llm_name]["vocab"])
    return BuiltPair(name, dtype, slm, llm, costs, vocab)


def spec_params(name: str) -> int:
    """A spec's parameter count from its shapes (no model built): what the plan prices."""
    s = SPECS[name]
    h, i, n, d = s["hidden"], s["inter"], s["layers"], s["hidden"] // s["heads"]
    attn = h * (s["heads"] * d) * 2 + h * (s["kv"] * d) * 2
    bias = (s["heads"] + 2 * s["kv"]) * d if s["family"] == "qwen2" else 0  # Qwen2's q/k/v biases
    layer = attn + bias + 3 * h * i + 2 * h
    return n * layer + s["vocab"] * h * (1 if s["tie"] else 2) + h


# -------------------------------------------------------------------------------------------------------- bandwidth
def gpu_name(device: str) -> str | None:
    """The GPU_BANDWIDTH key of the device measured on (from its name), None where it is not known."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(0)
    return next((k for k in GPU_BANDWIDTH if k in name), None)


def read_bandwidth(device: str, gib: float = 1.0, reps: int = 5) -> dict[str, float]:
    """This machine's fastest measured read, bytes/s, best of ``reps`` of each: a float32 sum, a copy (read + write
    counted) and a float32 matrix-vector product over ``gib`` GiB. The limit a decode step is held to on a CPU, where
    no datasheet figure applies (small matrices sit in cache, so the tensors are far larger than it)."""
    n = int(gib * 2**30) // 4
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    rows = 8192
    m = x[: (n // rows) * rows].view(rows, -1)
    v = torch.randn(m.shape[1], device=device)
    out: dict[str, float] = {}
    for name, fn, nbytes in (
        ("sum", lambda: x.sum(), 4 * n),
        ("copy", lambda: y.copy_(x), 8 * n),
        ("gemv", lambda: m @ v, 4 * m.numel()),
    ):
        best = float("inf")
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best
    out["best"] = max(out.values())
    return out


def sync(device: str) -> None:
    """Waits for the device's queued kernels: CUDA calls return before the work is done, so a timing without it
    measures only the launches."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_bytes(cost: ModelCost, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes of plain decoding as :class:`citer.decoding.cost.CostMeter` counts them: one prefill call, then
    ``new_tokens - 1`` one-token calls, each reading the weights once and every row's KV."""
    columns = 2 * prompt_len + sum(
        prompt_len + i + 1 for i in range(1, new_tokens)
    )  # per row: read + written
    return float(new_tokens * cost.weight_bytes + batch * cost.kv_bytes_per_token * columns)


# ------------------------------------------------------------------------------------------------------- the run
class BenchRun:
    """One run: settings, device and time budget, the report (written atomically after every measurement, so a run
    stopped by a time limit still leaves what it measured) and its log lines."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.t_start = time.perf_counter()
        self.cpu_start = cpu_times()
        self._scratch: Path | None = None
        bw = read_bandwidth(self.device) if not args.tiny else {"best": 1e10}
        gpu = args.gpu
        self.bandwidth = GPU_BANDWIDTH[gpu] if gpu else bw["best"]
        self.report: dict[str, Any] = {
            "bench": "speed",
            "created_unix": int(time.time()),
            "device": self._device_info(),
            "citer": os.environ.get("CITER_COMMIT") or "this checkout",
            "host": host_probe(),
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "bandwidth": {
                "limit_bytes_per_s": self.bandwidth,
                "source": f"datasheet ({gpu})" if gpu else "measured: the fastest float32 sum, copy or gemv",
                "measured_bytes_per_s": bw,
            },
            "settings": {k: v for k, v in vars(args).items() if k not in ("recompute", "out")},
            "definitions": {
                "ms_per_token": "wall time / (batch * new_tokens), prefill included; stat of the timed reps",
                "ratio_to_bw": "ms_per_token / bw_limit_ms_per_token",
                "bw_limit_ms_per_token": "bytes moved per token (weights once per call + KV read and written) / "
                "bandwidth.limit_bytes_per_s",
                "ratio_to_ideal": "ms_per_token / (llm_fraction * t(engine_llm) + t(engine_slm)), same batch, dtype",
                "llm_calls_per_step": "LLM forward calls / decoding steps (a step emits at most one token per row)",
            },
            "pairs": {},
            "rows": [],
            "notes": [],
            "errors": [],
        }

    def _device_info(self) -> dict[str, Any]:
        if not self.device.startswith("cuda"):
            return {"name": _cpu_name() + (" (--tiny smoke run; timings mean nothing)" if self.args.tiny else ""),
                    "cuda": False, "threads": torch.get_num_threads(), "vector": cpu_vector(),
                    "openmp": wait_env()}  # fmt: skip
        p = torch.cuda.get_device_properties(0)
        return {
            "name": torch.cuda.get_device_name(0),
            "cuda": True,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count,
            "cuda_version": torch.version.cuda,
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def left(self) -> float:
        """Seconds of ``--time-budget`` left."""
        return self.args.time_budget - self.elapsed()

    def note(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] note: {msg}", flush=True)
        self.report["notes"].append(msg)

    def error(self, where: str, exc: BaseException) -> None:
        """Logs a failed measurement with its traceback and keeps one line in the report (the rest still run)."""
        msg = f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        print(f"[{self.elapsed():6.1f}s] ERROR {msg}\n{traceback.format_exc()}", flush=True)
        self.report["errors"].append(msg)

    def save(self) -> None:
        """Writes the report to ``--out`` atomically (a temporary file, then a rename)."""
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        self.report["host"]["others_cpu_share"] = others_cpu_share(self.cpu_start, cpu_times())
        write_text(self.args.out, json.dumps(self.report, indent=1, default=float) + "\n")

    def scratch(self, name: str) -> Path:
        """A directory ``name`` kept across batches (a peer's GGUF files, written and quantized once per model and
        dtype) until :meth:`drop_scratch`."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="citer_bench_"))
        d = self._scratch / name
        d.mkdir(exist_ok=True)
        return d

    def drop_scratch(self) -> None:
        """Removes the scratch directories (gigabytes at real shapes) once their models are done with."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(wall seconds, result) of ``fn()``, the device synced before and after."""
        sync(self.device)
        t = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - t, out

    def prompts(self, vocab: int, batch: int, seed: int) -> list[list[int]]:
        """``batch`` random prompts of ``--prompt-len`` ids in [3, vocab), the same for the same seed."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (batch, self.args.prompt_len), generator=g).tolist()

    def print_row(self, r: dict[str, Any]) -> None:
        print(
            f"[{self.elapsed():6.1f}s] {r['pair']:<8} {r['dtype']:<4} b{r['batch']:<3} {r['variant']:<22}"
            f" {r['ms_per_token']:9.3f} ms/tok {r['tokens_per_s']:9.1f} tok/s f={_fmt(r.get('llm_fraction'))}"
            f" ideal×{_fmt(r.get('ratio_to_ideal'))} bw×{_fmt(r.get('ratio_to_bw'))}"
            f" reps={len(r['reps_s'])}" + (f" compiles={r['compiles']}" if r.get("compiles") else ""),
            flush=True,
        )


def host_probe() -> dict[str, Any]:
    """The machine and its load average (on a 2-core machine a busy neighbour slows torch's threads many times)."""
    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "cpu_model": _cpu_name()}
    with contextlib.suppress(OSError):
        out["loadavg_1m"] = os.getloadavg()[0]
    return out


def write_report(
    out: str | os.PathLike[str], report: dict[str, Any], bench: str, args: Any, wall_s: float
) -> None:
    """``report`` as JSON at ``out`` (atomically), stamped in ``reports/provenance.json`` (as bench ``bench`` with its
    arguments ``args``) where ``out`` lies in this checkout's ``reports/``; says where it wrote."""
    write_text(out, json.dumps(report, indent=1) + "\n")
    if Path(out).resolve().parent == Path(__file__).resolve().parent.parent / "reports":
        from citer.tracking.provenance import stamp_bench

        stamp_bench(out, bench, args, wall_s)
    print(f"wrote {out}", flush=True)


def cpu_times() -> tuple[float, float, float]:
    """(wall s, busy CPU s of the whole machine from /proc/stat, CPU s of this process and its children)."""
    busy = float("nan")
    with contextlib.suppress(OSError, ValueError, IndexError):
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.time(), busy, own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def others_cpu_share(start: tuple[float, float, float], now: tuple[float, float, float]) -> float | None:
    """The share of the machine's cores that other processes kept busy between two :func:`cpu_times`: ~0 on a quiet
    machine, 0.5 with one of two cores taken by a neighbour (what slows torch's threads many times)."""
    wall = now[0] - start[0]
    other = (now[1] - start[1]) - (now[2] - start[2])
    if not wall > 0 or other != other:
        return None
    return round(max(0.0, other) / (wall * (os.cpu_count() or 1)), 3)


# /proc/cpuinfo flags that decide which kernels a CPU decoder can use (torch's oneDNN, llama.cpp's ggml): what a bench
# report lists to describe its CPU (records are compared by the shorter citer.tracking.provenance.ROUNDING_FLAGS).
DECODER_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")  # fmt: skip


def cpu_vector() -> list[str]:
    """This CPU's vector extensions among ``DECODER_FLAGS`` (``Features`` on ARM), in that order."""
    return host_cpu().listed(DECODER_FLAGS)


def cpu_precision() -> str:
    """The precision a CPU decoder wins in on this host: ``bf16`` where the CPU has bf16 products (AVX512-BF16 or
    AMX-BF16), else ``fp32`` (an AVX2-only CPU converts bf16 in software, slower than float32's twice the bytes)."""
    cpu = host_cpu()
    return "bf16" if cpu.has("avx512_bf16") or cpu.has("amx_bf16") else "fp32"


def _cpu_name() -> str:
    return host_cpu().model or "cpu"


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------------------------------- derived
def derive_timings(report: dict[str, Any], stat: str = "median") -> None:
    """(Re)compute every timing field of ``report["rows"]`` from the raw ``reps_s`` with ``stat`` (median or min):
    per-token times, ratios to the bandwidth limit and to the ideal."""
    pick = min if stat == "min" else statistics.median
    rows = report["rows"]
    for r in rows:
        reps = r.get("reps_s")
        if not reps:
            continue
        w = pick(reps)
        ntok = r["batch"] * r["new_tokens"]
        r["wall_s"] = w
        r["ms_per_token"] = 1e3 * w / ntok
        r["min_ms_per_token"] = 1e3 * min(reps) / ntok
        r["tokens_per_s"] = ntok / w
        if r.get("bw_limit_ms_per_token"):
            r["ratio_to_bw"] = r["ms_per_token"] / r["bw_limit_ms_per_token"]
    idx = {(r["pair"], r["dtype"], r["batch"], r["variant"]): r for r in rows}
    for r in rows:
        key, hf = (r["pair"], r["dtype"], r["batch"]), "_hf_forward" * r["variant"].endswith("_hf_forward")
        sl, ll = idx.get((*key, "engine_slm" + hf)), idx.get((*key, "engine_llm" + hf))
        if sl is None or ll is None or "ms_per_token" not in sl or "ms_per_token" not in ll:
            continue
        if r["variant"].startswith(ROUTED) and r.get("llm_fraction") is not None:
            ideal = r["llm_fraction"] * ll["ms_per_token"] + sl["ms_per_token"]
            r["ideal_ms_per_token"] = ideal
            r["ratio_to_ideal"] = r["ms_per_token"] / ideal
    report["stat"] = stat


ROUTED = ("routed", "shared", "overlap")
# The LLM-only decoders a routed row is compared with: HF eager and compiled, our engine (as it runs, and eager), the
# peers; llama.cpp's quantized copies too (``llama_cpp_llm_q4_0``...: ``is_llm_only``).
LLM_ONLY = ("hf_llm", "hf_llm_static_compiled", "engine_llm", "engine_llm_eager", "llama_cpp_llm", "vllm_llm")
# The routed f=0.1 decoders a target takes the best of: plain, shared LLM calls, overlapped, both.
# The routed row with the params' engine (what `citer route` runs), timed in turn with the LLM-only baselines, and the
# rows with other engine settings, timed in the next group (speed_measure.variants): a ratio across groups carries the
# host's drift between their minutes, so only the first makes the headline.
PARAMS_ROUTED = "routed_f0.1"
OTHER_ROUTED = ("shared_f0.1", "overlap_f0.1", "overlap_shared_f0.1")


def is_llm_only(variant: str) -> bool:
    """A row of an LLM-only decoder, at any precision: the fastest of them is the baseline, whatever its bits."""
    return variant in LLM_ONLY or variant.startswith("llama_cpp_llm_")


def label(r: dict[str, Any]) -> str:
    """A row's name in the targets: its variant and precision (a quantized copy's, with the dtype it came from)."""
    prec, dtype = r.get("precision", r["dtype"]), r["dtype"]
    return f"{r['variant']} ({prec})" if prec == dtype else f"{r['variant']} ({prec} from {dtype})"


def expected_llm_only(settings: dict[str, Any], batch: int, pair: str) -> list[str]:
    """The LLM-only baselines a run with ``settings`` set out to measure at ``batch``: a target compares against all
    of them, and names the ones missing rather than compare against fewer. llama.cpp: at ``llama_cpp_batches`` (a
    report from before that setting: batch 1), in the model's dtype and at each of ``llama_cpp_quants``."""
    out = ["hf_llm", "engine_llm"]
    if settings.get("compile") and batch in settings.get("compile_batches", []):
        out.append("hf_llm_static_compiled")
    if settings.get("engine_eager"):
        out.append("engine_llm_eager")
    llama = SPECS[PAIRS[pair][1]]["family"] == "llama"
    if settings.get("llama_cpp_python") and batch in settings.get("llama_cpp_batches", [1]) and llama:
        out.append("llama_cpp_llm")
        out += [f"llama_cpp_llm_{q.lower()}" for q in settings.get("llama_cpp_quants", [])]
    if settings.get("vllm_python"):
        out.append("vllm_llm")
    return out


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issues' targets per pair, from the derived rows: routed f=0.1 with the params' engine over the best
    LLM-only decoder per batch (every dtype and precision measured, llama.cpp's quantized copies included), read
    between rows timed in turn, and over the best llama.cpp row alone; the best routed row with other engine settings
    over the same baseline, apart (``other_routed``: timed in the next group); the engine's LLM-only step against
    the bandwidth limit; routed against assisted generation."""
    rows = [r for r in report["rows"] if "tokens_per_s" in r]
    settings = report.get("settings", {})
    out: dict[str, Any] = {}
    for pair in report["pairs"]:
        s: dict[str, Any] = {}
        mine = [r for r in rows if r["pair"] == pair]
        for b in sorted({r["batch"] for r in mine}):
            at = [r for r in mine if r["batch"] == b]
            llm_only = [r for r in at if is_llm_only(r["variant"])]
            routed = [r for r in at if r["variant"] == PARAMS_ROUTED]
            others = [r for r in at if r["variant"] in OTHER_ROUTED]
            missing = sorted(set(expected_llm_only(settings, b, pair)) - {r["variant"] for r in llm_only})
            if missing:
                s[f"b{b}_baseline_missing"] = missing
            if llm_only and routed and not missing:
                best = max(llm_only, key=lambda r: r["tokens_per_s"])
                top = max(routed, key=lambda r: r["tokens_per_s"])
                s[f"b{b}_routed_f0.1_over_best_llm_only"] = top["tokens_per_s"] / best["tokens_per_s"]
                s[f"b{b}_best_llm_only"] = label(best)
                s[f"b{b}_best_routed_f0.1"] = label(top)
                if "ratio_to_ideal" in top:
                    s[f"b{b}_best_routed_f0.1_ratio_to_ideal"] = top["ratio_to_ideal"]
                if others:
                    other = max(others, key=lambda r: r["tokens_per_s"])
                    s[f"b{b}_other_routed_f0.1_over_best_llm_only"] = (
                        other["tokens_per_s"] / best["tokens_per_s"]
                    )
                    s[f"b{b}_best_other_routed_f0.1"] = label(other)
            elif routed and missing:
                s[f"b{b}_routed_f0.1_over_best_llm_only"] = f"baseline missing: {', '.join(missing)}"
            elif not routed and settings.get("fractions"):
                s[f"b{b}_routed_f0.1_over_best_llm_only"] = "routed rows missing: none measured at this batch"
            llama = [r for r in llm_only if r["variant"].startswith("llama_cpp_llm")]
            llama_missing = [m for m in missing if m.startswith("llama_cpp_llm")]
            if routed and llama_missing:
                s[f"b{b}_routed_f0.1_over_best_llama_cpp"] = f"baseline missing: {', '.join(llama_missing)}"
            elif routed and llama:
                fast = max(llama, key=lambda r: r["tokens_per_s"])
                top = max(routed, key=lambda r: r["tokens_per_s"])
                s[f"b{b}_routed_f0.1_over_best_llama_cpp"] = top["tokens_per_s"] / fast["tokens_per_s"]
                s[f"b{b}_best_llama_cpp"] = label(fast)
            eng = [r for r in at if r["variant"] == "engine_llm" and "ratio_to_bw" in r]
            if eng:
                fast = min(eng, key=lambda r: r["ratio_to_bw"])
                s[f"b{b}_engine_llm_ratio_to_bw"] = fast["ratio_to_bw"]
                s[f"b{b}_engine_llm_dtype"] = fast["dtype"]
            slm = [r for r in at if r["variant"] == "engine_slm" and "ratio_to_bw" in r]
            if slm:
                s[f"b{b}_engine_slm_ratio_to_bw"] = min(r["ratio_to_bw"] for r in slm)
            for r in at:
                if r["variant"].startswith("assisted_alpha") and routed:
                    top = max(routed, key=lambda x: x["tokens_per_s"])
                    s[f"b{b}_routed_f0.1_over_{r['variant']}"] = top["tokens_per_s"] / r["tokens_per_s"]
        out[pair] = s
    return out


def recompute(files: list[str], stat: str, out: str) -> dict[str, Any]:
    """Merge result files (one device: e.g. one pair per process) and re-derive timings and targets."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    merged = json.loads(json.dumps(reports[0]))
    merged["runs"] = []
    for f, r in zip(files, reports, strict=True):
        run = {
            k: r.get(k) for k in ("device", "host", "citer", "torch", "transformers", "settings", "elapsed_s")
        }
        merged["runs"].append({"file": Path(f).name, **run})
        for row in r["rows"]:  # a batch measured by two runs keeps both rows, each naming its run
            row.setdefault("run", Path(f).name)
        if r is reports[0]:
            merged["rows"] = r["rows"]
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
    write_text(out, json.dumps(merged, indent=1, default=float) + "\n")
    return merged
