"""bf16 linears of a few rows on the CPU at the memory's speed: a small AVX512-BF16 kernel, built at first use.

A decode step's linears are matrix-vector products, bound by reading the weight once. On the Xeons this project runs
on (AVX512-BF16, AMX), torch's bf16 linear streams a weight at well under the memory's rate for one to four rows and
costs ~25 µs a call before any work; the kernel in ``cpu_linear.cpp`` reads each weight row once per call whatever the
rows (up to :data:`MAX_ROWS`), sums in fp32 with ``vdpbf16ps`` and costs ~2 µs a call (measurements:
docs/results.md). Bigger calls (prefills, long catch-ups) keep torch's linear, whose AMX kernels are compute-bound
there. It is a ``citer::linear_bf16`` operator, so a compiled forward calls it like any other.

The kernel is built with ``torch.utils.cpp_extension`` at the first bf16 CPU call (tens of seconds once, cached in
``TORCH_EXTENSIONS_DIR``). Where the CPU lacks AVX512-BF16, the build fails, or ``CITER_CPU_LINEAR=0``, every call is
torch's ``F.linear``, with one warning for a failed build. Sums in fp32 in another order than torch's: bf16 outputs
may differ in the last bit; float32 never takes this path.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 4  # rows (B x Q) up to which a call takes the kernel
_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]
_state: dict[str, bool] = {}
_lock = threading.Lock()


def _cpu_has_bf16_dot() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags.split()


def available() -> bool:
    """True when the kernel is built and loaded (building it on the first call that asks)."""
    got = _state.get("ok")
    if got is not None:
        return got
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok = os.environ.get("CITER_CPU_LINEAR", "1") != "0" and _cpu_has_bf16_dot()
        if ok:
            try:
                from torch.utils.cpp_extension import load

                load("citer_cpu_linear", [str(_SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                     is_python_module=False, verbose=False)  # fmt: skip
                _register_fake()
            except Exception as err:  # no compiler, no ninja, an old assembler: torch's linear serves
                warnings.warn(
                    f"the bf16 CPU linear kernel could not be built ({err}); using torch's", stacklevel=2
                )
                ok = False
        _state["ok"] = ok
        return ok


def _register_fake() -> None:
    @torch.library.register_fake("citer::linear_bf16")
    def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``; a bf16 call of at most :data:`MAX_ROWS` rows on the CPU runs the kernel."""
    if (
        x.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and w.dtype is torch.bfloat16
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and w.stride(-1) == 1
        and available()
    ):
        return torch.ops.citer.linear_bf16(x, w, b)
    return F.linear(x, w, b)
