"""Linears on the CPU: for bf16 a small AVX512-BF16/AMX kernel for a few rows and oneDNN's prepacked weights for more;
for float32 on AMD CPUs a small AVX2 kernel for a few rows and oneDNN's prepacked weights for more.

A decode step's linears are matrix-vector products, bound by reading the weight once. On the Xeons this project runs on
(AVX512-BF16, AMX), torch's bf16 linear streams a weight at well under the memory's rate for one to four rows and costs
tens of microseconds a call before any work; the kernel in ``cpu_linear.cpp`` reads each weight row once per call
whatever the rows, sums in fp32 and costs a few microseconds a call (measurements: docs/results.md). One row runs
blocks of four weight rows by ``vdpbf16ps`` (``citer::linear_bf16``), each block prefetching the thread's next; 2 to
:data:`AMX_MAX_ROWS` rows, on a CPU with AMX (:func:`amx`), run its tiles with the weight read in place as their left
operand (``citer::linear_bf16_amx``: no copy of the weight; a row's outputs do not depend on the rows beside it); on a
CPU without AMX (an AVX512-BF16 EPYC) the blocks take up to :data:`MAX_ROWS` rows. Both are operators, so a compiled
forward calls them like any other.

Bigger calls of up to :data:`PACKED_MAX_ROWS` rows (batched steps, catch-ups, short prefills) run oneDNN's linear on a copy of
the weight laid out once in its blocked format (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing
does for a compiled CPU model): torch's ``F.linear`` lays the plain weight out again at every call, which at a few to a
few hundred rows is a large part of the call. The copy is made at a weight's first such call and kept while the weight
lives (weakly keyed; made again if the weight changes in place), so a model whose calls take this path holds its bf16
weights twice (``CITER_CPU_LINEAR=0`` turns both paths off). Its outputs are ``F.linear``'s (the same oneDNN kernels).
Compiled forwards keep ``F.linear``: inductor packs their weights itself.

The kernel is built with ``torch.utils.cpp_extension`` at the first bf16 CPU call (tens of seconds once, cached in
``TORCH_EXTENSIONS_DIR``). Where the CPU lacks AVX512-BF16 (oneDNN emulates bf16 there), the build fails, or
``CITER_CPU_LINEAR=0``, every call is torch's ``F.linear`` (a failed build alone keeps the packed weights), with one
warning for a failed build. Sums in fp32 in another order than torch's: bf16 outputs may differ in the last bit.

float32 on an AMD CPU: torch's ``F.linear`` is MKL's SGEMM, which on AMD runs a path far from the memory's rate for a
few rows (several times one row's time for 2 to 32 rows: docs/results.md). oneDNN's linear on the packed weight is no
slower up to 2,048 rows, and a row's products do not depend on the rows beside it (MKL's do). For up to
:data:`F32_MAX_ROWS` rows (decode steps, short catch-ups) the AVX2 kernel in ``cpu_linear_f32.cpp`` is faster still: it
streams eight weight rows at once for one row and, for more, works in tiles of four weight rows by three input rows
held in registers; it reads the weight from memory once per call (oneDNN's packed layout reads it at about 20 GB/s on
a Zen 3 EPYC, the kernel at about 25, the machine's best read ~30: docs/results.md); it is a
``citer::linear_f32`` operator built like the bf16 one (into one extension with the decode step's other ops,
:mod:`citer.decoding.cpu_step`), and a row's sums run in one order whatever the call holds. Both
sum in another order than ``F.linear``: outputs differ from it in the last bits, and a row's outputs in a call of up to
:data:`F32_MAX_ROWS` rows from the same row's in a bigger call. Only weights of at least :data:`FP32_PACKED_MIN` elements
take either: below, a call's fixed cost exceeds the product (so tiny models, the pipeline's own among them, keep
``F.linear`` bit for bit). Intel CPUs keep ``F.linear`` in float32 (MKL is tuned there; not measured against oneDNN or
the kernel yet). The packed copy doubles the float32 weights a process holds, as for bf16.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from citer.ops.cpu import host_cpu

MAX_ROWS = 4  # rows (B x Q) up to which a call takes the kernel's vdpbf16ps blocks where the CPU has no AMX
# Rows up to which a call takes the kernel's AMX tiles where the CPU has them (one row keeps the vdpbf16ps blocks,
# faster there: docs/results.md): four C tiles of 16 rows beside a weight tile read once a step, more rows in a second
# pass over each group of the weight while it is in L2; up to 96 rows they beat the packed weight (docs/results.md),
# and a row's outputs stay those of the same row in any smaller call.
AMX_MAX_ROWS = 96
# Rows up to which a call takes the packed weight; bigger products amortise F.linear's layout.
PACKED_MAX_ROWS = 512
# float32 weights (out x in elements) from which an AMD CPU's calls take the packed weight: the crossover bench/cpu_linear.py
# measured (docs/results.md).
FP32_PACKED_MIN = 1 << 17
# Rows (B x Q) up to which a float32 call on such a weight takes the AVX2 kernel: on a Zen 3 EPYC its register tiles
# beat the packed weight up to 48 rows and matched it at 64 (docs/results.md); a decode step of up to 48 rows (the
# batches of 32 the benches run among them) stays on one kernel, so such a step's row computes the same sums whatever
# the batch.
F32_MAX_ROWS = 48
# name -> (extension, sources, compiler flags) of the kernels built at first use
_KERNELS = {
    "bf16": (
        "citer_cpu_linear",
        [Path(__file__).with_name("cpu_linear.cpp"), Path(__file__).with_name("cpu_step_bf16.cpp")],
        [
            "-O3",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mamx-tile",
            "-mamx-bf16",
            "-fopenmp",
        ],
    ),
    "f32": (
        "citer_cpu_linear_f32",
        [Path(__file__).with_name("cpu_linear_f32.cpp"), Path(__file__).with_name("cpu_step_f32.cpp")],
        ["-O3", "-mavx2", "-mfma", "-fopenmp"],
    ),
}
_state: dict[str, bool] = {}
_lock = threading.Lock()
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (its version when packed, the packed copy)


def _bf16_cpu() -> bool:
    """The switch and the CPU: both bf16 paths need AVX512-BF16 and neither runs with ``CITER_CPU_LINEAR=0``."""
    got = _state.get("cpu")
    if got is None:
        got = _state["cpu"] = os.environ.get("CITER_CPU_LINEAR", "1") != "0" and host_cpu().has("avx512_bf16")
    return got


def _enabled() -> bool:
    """Whether bf16 calls may take the kernel or the packed weight: :func:`_bf16_cpu`, and :func:`use_bf16` did not
    turn them off."""
    return _bf16_cpu() and _state.get("bf16_on", True)


def use_bf16(on: bool) -> None:
    """Let bf16 calls take the kernel and the packed weight (the default where :func:`_enabled`'s checks hold) or
    only ``F.linear``, for this process: what ``bench/slm_step.py`` times in turn. A kernel already built is kept."""
    _state["bf16_on"] = on


def _fp32_packed() -> bool:
    """Whether float32 calls may take oneDNN's packed weight: an AMD CPU (where MKL's few-row SGEMM is slow), oneDNN
    built in, and not ``CITER_CPU_LINEAR=0``."""
    got = _state.get("fp32")
    if got is None:
        got = _state["fp32"] = (
            os.environ.get("CITER_CPU_LINEAR", "1") != "0"
            and host_cpu().amd
            and torch.backends.mkldnn.is_available()
        )
    return got


def use_float32_packed(on: bool, kernel: bool = True, step_ops: bool = True) -> None:
    """Turn the float32 path on (where :func:`_fp32_packed`'s CPU check holds) or off for this process, and with it on
    the AVX2 kernel (``kernel=False``: the packed weight for every row count) and the decode step's C++ ops
    (``step_ops``, :mod:`citer.decoding.cpu_step`, which need the kernel): what ``bench/cpu_linear.py --engine`` and
    ``bench/slm_step.py`` time in turn. Packed copies already made and a kernel already built are kept."""
    _state.pop("fp32", None)
    _state["fp32"] = on and _fp32_packed()
    _state["f32_kernel"] = kernel
    _state["step_ops"] = step_ops


def use_step_ops(on: bool) -> None:
    """Let the decode step's C++ ops serve (the default) or not, in either dtype: what ``bench/slm_step.py`` times in
    turn."""
    _state["step_ops"] = on


def step_ops_on() -> bool:
    """Whether the decode step's C++ ops may serve (not switched off by :func:`use_float32_packed` or
    :func:`use_step_ops`)."""
    return _state.get("step_ops", True)


def row_ops(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """Whether a bf16 CPU call on ``x`` (and weight ``w``) may take the extension's row-wise ops (the RMS norm, RoPE's
    rotation, silu(gate) * up) outside a decode step: eager, without autograd, the step ops on and the kernel built."""
    return (
        x.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and (w is None or w.dtype is torch.bfloat16)
        and step_ops_on()
        and not torch.compiler.is_compiling()
        and not _needs_grad(x, w)
        and available()
    )


def available() -> bool:
    """True when the bf16 kernel may serve this process's bf16 calls (:func:`_enabled`) and is built and loaded
    (building it on the first call that asks)."""
    return _enabled() and _built("bf16", _bf16_cpu)


def f32_available() -> bool:
    """True when the float32 AVX2 kernel may serve this process's float32 calls (an AMD CPU with AVX2 and FMA, the
    float32 path on) and is built and loaded (building it on the first call that asks)."""
    return (
        _fp32_packed()
        and _state.get("f32_kernel", True)
        and _built("f32", lambda: host_cpu().has("avx2") and host_cpu().has("fma"))
    )


def _built(kind: str, cpu_ok: Callable[[], bool]) -> bool:
    """Whether kernel ``kind`` is loaded: built on the first call where ``cpu_ok()``; a failed build warns once and
    is not tried again in this process."""
    key = f"built_{kind}"
    got = _state.get(key)
    if got is not None:
        return got
    with _lock:
        if key in _state:
            return _state[key]
        ok = cpu_ok()
        if ok:
            name, sources, flags = _KERNELS[kind]
            try:
                from torch.utils.cpp_extension import load

                load(name, [str(p) for p in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
                     verbose=False)  # fmt: skip
                _register_fake(f"citer::linear_{kind}")
                if kind == "bf16":
                    _register_fake("citer::linear_bf16_amx")
                    _state["amx"] = bool(torch.ops.citer.bf16_amx())
            except Exception as err:  # no compiler, no ninja, an old assembler: the other linears serve
                warnings.warn(
                    f"the {kind} CPU linear kernel could not be built ({err}); using torch's", stacklevel=3
                )
                ok = False
        _state[key] = ok
        return ok


def amx() -> bool:
    """Whether bf16 calls of 2 to :data:`AMX_MAX_ROWS` rows may take the kernel's AMX tiles: the kernel is built, the
    CPU has AMX and Linux grants the process its state (asked once, in C++, when the kernel loads), and
    :func:`use_amx` did not turn it off."""
    return available() and _state.get("amx", False) and _state.get("amx_on", True)


def use_amx(on: bool) -> None:
    """Let bf16 calls of 2 to :data:`AMX_MAX_ROWS` rows take the AMX tiles (the default where the CPU has them) or not
    (the vdpbf16ps blocks up to :data:`MAX_ROWS` rows, then the packed weight): what ``bench/slm_step.py`` times in
    turn."""
    _state["amx_on"] = on


def bf16_kernel(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The kernel op a bf16 call with input ``x`` (..., K) takes on this CPU (``citer::linear_bf16`` or
    ``citer::linear_bf16_amx``), or None (the packed weight or ``F.linear``); the kernel must be available."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 1:
        return torch.ops.citer.linear_bf16
    if 2 <= rows <= AMX_MAX_ROWS and x.shape[-1] % 32 == 0 and amx():
        return torch.ops.citer.linear_bf16_amx
    if rows <= MAX_ROWS:
        return torch.ops.citer.linear_bf16
    return None


def _register_fake(op: str) -> None:
    @torch.library.register_fake(op)
    def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` (out, in) in oneDNN's blocked layout, made at its first call and kept while ``w`` lives."""
    try:
        version = w._version
    except RuntimeError:
        version = -1  # an inference tensor: no version counter (changed in place only under inference mode)
    got = _packed.get(w)
    if got is not None and got[0] == version:
        return got[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    _packed[w] = (version, packed)
    return packed


def _eager_inference(w: torch.Tensor, x: torch.Tensor | None = None, b: torch.Tensor | None = None) -> bool:
    """A call may take the packed weight or the float32 kernel (neither has a backward): not while compiling (checked
    first: dynamo cannot trace the checks after it, and inductor lays a graph's weights out for oneDNN itself) and not
    where autograd would run through ``w``, ``x`` or ``b``."""
    return not torch.compiler.is_compiling() and not _needs_grad(w, x, b)


def float32_path(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> str:
    """Which linear a float32 call ``linear(x, w, b)`` runs on this CPU: ``"kernel"`` (the AVX2 kernel), ``"packed"``
    (oneDNN's packed weight) or ``"torch"`` (``F.linear``); building the kernel where it may serve and is not built."""
    if x.device.type != "cpu" or x.dtype is not torch.float32 or w.dtype is not x.dtype or w.dim() != 2:
        return "torch"
    if (
        w.stride(-1) != 1
        or w.numel() < FP32_PACKED_MIN
        or not _eager_inference(w, x, b)
        or not _fp32_packed()
    ):
        return "torch"
    if x.numel() // max(x.shape[-1], 1) <= F32_MAX_ROWS and f32_available():
        return "kernel"
    return "packed"


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``; a bf16 call on a CPU with AVX512-BF16 runs the kernel (at most :data:`MAX_ROWS` rows)
    or oneDNN's linear on the packed weight (at most :data:`PACKED_MAX_ROWS`, eager and without autograd); a float32
    call on an AMD CPU over a weight of at least :data:`FP32_PACKED_MIN` elements (eager and without autograd) the
    AVX2 kernel (at most :data:`F32_MAX_ROWS` rows) or the packed weight (any rows)."""
    if x.device.type != "cpu" or w.dtype is not x.dtype or w.dim() != 2 or w.stride(-1) != 1:
        return F.linear(x, w, b)
    if x.dtype is torch.bfloat16 and _enabled():
        rows = x.numel() // max(x.shape[-1], 1)
        kernel = bf16_kernel(x) if rows <= AMX_MAX_ROWS and not _needs_grad(x, w, b) and available() else None
        if kernel is not None:
            return kernel(x, w, b)
        if rows <= PACKED_MAX_ROWS and _eager_inference(w, x, b) and torch.backends.mkldnn.is_available():
            return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), b, "none", [], "")
    elif x.dtype is torch.float32:
        path = float32_path(x, w, b)
        if path == "kernel":
            return torch.ops.citer.linear_f32(x, w, b)
        if path == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), b, "none", [], "")
    return F.linear(x, w, b)


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    """Autograd would run through one of ``ts``: the kernels have no backward, so such a call takes ``F.linear``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)
