"""One run of ``bench/gpu.py``: its settings, device and time budget, the report it writes (atomically, after every
measurement, so a run stopped by a time limit still leaves what it measured), and its log lines."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_timing import host_probe, sync
from citer.decoding.cost import GPU_BANDWIDTH
from citer.decoding.engine import RoutedEngine

# RoutedEngine arguments of shared LLM calls: an older engine (a pinned commit) lacks them, and its shared variants
# are skipped.
SHARED_KWARGS = ("llm_min_rows", "llm_max_wait_steps")


class BenchRun:
    """State and bookkeeping of one run; the measurements (bench/gpu_engines.py and the others) append rows to
    ``report["rows"]`` and call :meth:`save`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.device = "cpu" if args.tiny else "cuda"
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        sig = inspect.signature(RoutedEngine.__init__).parameters
        self.has_shared = all(k in sig for k in SHARED_KWARGS)
        self.has_overlap = "overlap" in sig and bool(args.overlap_fractions)
        self.report: dict[str, Any] = {
            "bench": "bench/gpu.py",
            "created_unix": time.time(),
            "device": self._device_info(),
            "citer": {
                "path": str(Path(sys.modules[RoutedEngine.__module__].__file__).parents[2]),
                "commit": os.environ.get("CITER_COMMIT", "working tree"),
            },
            "host": host_probe(self.device),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "gpu_bandwidth_bytes_per_s": GPU_BANDWIDTH[args.gpu],
            "gpu_bandwidth_name": args.gpu,
            "dtype": str(self.dtype).replace("torch.", ""),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "shared_llm_calls": (
                "measured (RoutedEngine takes llm_min_rows, llm_max_wait_steps)"
                if self.has_shared
                else "skipped: this RoutedEngine has no llm_min_rows / llm_max_wait_steps"
            ),
            "definitions": {
                "ms_per_token": "wall time / tokens generated in the batch (batch * new_tokens), prefill included",
                "ms_per_row_token": "wall time / new_tokens (the latency a row sees per token)",
                "ideal_ms_per_token": "f * t(engine_llm) + t(engine_slm), same batch, f = measured LLM fraction",
                "bw_limit_ms_per_token": "bytes moved per token / bandwidth (weights once per call + KV read/written)",
                "llm_calls_per_step": "LLM forward calls / decoding steps (a step emits at most one token per row)",
            },
            "pairs": {},
            "rows": [],
            "notes": [],
            "errors": [],
        }
        if not self.has_shared:
            self.note("shared variants skipped: RoutedEngine has no llm_min_rows / llm_max_wait_steps")

    def _device_info(self) -> dict[str, Any]:
        """Name, memory and SM count of the GPU measured on (only a label for --tiny)."""
        if self.device == "cpu":
            return {"name": "cpu (--tiny smoke run; timings mean nothing)", "cuda": False}
        p = torch.cuda.get_device_properties(0)
        return {
            "name": torch.cuda.get_device_name(0),
            "cuda": True,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count,
            "cuda_version": torch.version.cuda,
        }

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t_start

    def left(self) -> float:
        """Seconds of ``--time-budget`` left: later measurements are skipped below their own margins."""
        return self.args.time_budget - self.elapsed()

    def note(self, msg: str) -> None:
        """Logs ``msg`` and keeps it in the report's notes."""
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
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.report, f, indent=1, default=float)
            f.write("\n")
        os.replace(tmp, out)
        from citer.provenance import stamp_bench  # stdlib and torch only, as everything here

        stamp_bench(out, "gpu", self.args, self.elapsed())

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

    def print_rows(self, rows: list[dict]) -> None:
        """One log line per measured row: time per token, LLM fraction and the two ratios."""
        for r in rows:
            print(
                f"[{self.elapsed():6.1f}s] {r['pair']:<9} b{r['batch']:<3} {r['variant']:<26}"
                f" {r['ms_per_token']:8.3f} ms/tok  {r['tokens_per_s']:9.1f} tok/s"
                f"  f={_fmt(r.get('llm_fraction'))}  ideal×{_fmt(r.get('ratio_to_ideal'))}"
                f"  bw×{_fmt(r.get('ratio_to_bw'))}  llm/step={_fmt(r.get('llm_calls_per_step'))}",
                flush=True,
            )


def _fmt(v: Any) -> str:
    """A log field: ``-`` for a missing value, floats to 3 decimals."""
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _version(pkg: str) -> str:
    """``pkg``'s version, or ``?`` where it cannot be imported."""
    try:
        return __import__(pkg).__version__
    except Exception:  # pragma: no cover - reported, not fatal
        return "?"
