"""The bf16 CPU linear kernel (citer.kernels.cpu_linear): the same products as torch's linear up to bf16 rounding, for
one to four rows, any width (a masked tail), with and without bias, eagerly and inside a compiled graph; on an AMX CPU
2 to 32 rows on its tiles (a row's outputs independent of the rows beside it); more rows
take oneDNN's linear on a prepacked weight, torch's linear bit for bit, repacked when the weight changes in place;
float32 on an AMD CPU (the gate, then the path switched on wherever the test runs), over a weight of at least
FP32_PACKED_MIN elements, takes oneDNN's packed weight (torch's linear up to float32 rounding, a row's products
independent of the rows beside it); everything else is torch's linear, bit for bit."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from citer.kernels import cpu_linear
from citer.ops.cpu import HostCpu

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX512-BF16 or no compiler here")
needs_mkldnn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
needs_bf16 = pytest.mark.skipif(
    not cpu_linear._enabled(), reason="no AVX512-BF16 here: bf16 takes torch's linear"
)


def test_the_kernel_builds_wherever_the_cpu_and_a_compiler_can_run_it():
    """The kernel's tests skip where it is unavailable, so a kernel that stops compiling must fail here instead of
    skipping them all on the CPUs it serves."""
    cpu = cpu_linear.host_cpu()
    if not cpu.has("avx512_bf16") or os.environ.get("CITER_CPU_LINEAR") == "0":
        pytest.skip("no AVX512-BF16 here (or the kernels switched off)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    assert cpu_linear.available(), "the bf16 kernel did not build on a CPU it serves (see the warning above)"
    if cpu.has("amx_tile") and cpu.has("amx_bf16"):
        release = re.match(r"(\d+)\.(\d+)", os.uname().release)
        if release and tuple(map(int, release.groups())) >= (
            5,
            16,
        ):  # Linux grants the tiles' state from 5.16
            assert cpu_linear.amx(), "an AMX CPU whose kernel grants the tiles, but no tiles"


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@needs_kernel
@pytest.mark.parametrize(
    ("shape", "n", "bias"),
    [((1, 576), 1536, False), ((3, 101), 7, True), ((4, 2048), 33, True), ((1, 2, 64), 130, False)],
)
def test_the_kernel_computes_the_linear(shape, n, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape).bfloat16()
    w = torch.randn(n, shape[-1]).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    got = torch.ops.citer.linear_bf16(x, w, b)
    assert got.shape == (*shape[:-1], n) and got.dtype is torch.bfloat16
    assert _close(got, x, w, b) < 1e-2  # bf16 rounding of the output, fp32 sums
    assert torch.equal(cpu_linear.linear(x, w, b), got)  # what the forwards call


needs_amx = pytest.mark.skipif(not cpu_linear.amx(), reason="no AMX here (or Linux refused its state)")


def test_an_installed_package_carries_every_file_the_kernels_build_reads():
    """pyproject's package data holds each kernel's sources and the headers they include (a wheel without a header
    builds no kernel: every bf16 call falls back to torch's linear with a warning)."""
    root = Path(cpu_linear.__file__).parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "citer.kernels"
    ]
    needed = set()
    for _, sources, _ in cpu_linear._KERNELS.values():
        for src in sources:
            needed.add(src.name)
            needed |= set(re.findall(r'#include "([^"]+)"', src.read_text()))
    assert needed and all((Path(cpu_linear.__file__).parent / name).is_file() for name in needed)
    assert all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in needed), (needed, patterns)


@needs_amx
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [
        (2, 960, 576, False),
        (5, 1000, 576, True),
        (16, 77, 64, True),
        (8, 33, 2048, False),
        (3, 31, 32, True),
        (17, 96, 64, True),
        (32, 1000, 576, False),
        (33, 47, 96, True),
        (64, 200, 64, False),
        (65, 48, 64, True),
        (96, 100, 576, False),
    ],
)
def test_the_amx_tiles_compute_the_linear_and_a_rows_outputs_do_not_depend_on_the_others(rows, n, k, bias):
    """Weights of 16-row groups and a tail (n % 16 rows: the vdpbf16ps blocks), up to AMX_MAX_ROWS rows (a C tile
    for every 16)."""
    torch.manual_seed(6)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    got = torch.ops.citer.linear_bf16_amx(x, w, b)
    assert got.shape == (rows, n) and _close(got, x, w, b) < 1e-2
    assert torch.equal(cpu_linear.linear(x, w, b), got)  # what the forwards call for 2-AMX_MAX_ROWS rows
    for i in range(
        rows
    ):  # alone (beside a copy of itself: one row takes the other kernel) and beside the others
        pair = torch.ops.citer.linear_bf16_amx(x[i : i + 1].expand(2, k).contiguous(), w, b)
        assert torch.equal(pair[0], got[i]) and torch.equal(pair[1], got[i])


@needs_amx
def test_non_finite_sums_come_out_alike_from_every_kernel_path():
    """inf x 0 (NaN) and inf sums where torch's linear has them, and the same bits from the one-row blocks, the tiles
    and the tiles' second right tile (cpu_bf16.h's one rounding)."""
    torch.manual_seed(8)
    x, w = torch.randn(20, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    x[::2, 0], x[1, 3], w[::3, 0] = float("inf"), float("-inf"), 0.0
    ref = F.linear(x.float(), w.float())
    blocks = torch.cat([torch.ops.citer.linear_bf16(x[i : i + 1], w, None) for i in range(20)])
    pairs = torch.cat([torch.ops.citer.linear_bf16_amx(x[i : i + 2], w, None) for i in range(0, 20, 2)])
    tiles = torch.ops.citer.linear_bf16_amx(x, w, None)
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    for got in (blocks, pairs, tiles):
        assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.equal(
            got[torch.isinf(ref)], ref[torch.isinf(ref)].bfloat16()
        )
        assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))


@needs_amx
def test_calls_the_amx_tiles_cannot_take_are_the_blocks_exactly():
    torch.manual_seed(7)
    rows = cpu_linear.AMX_MAX_ROWS + 1
    for x in (
        torch.randn(4, 100).bfloat16(),
        torch.randn(rows, 64).bfloat16(),
    ):  # K % 32, more rows than the tiles
        w = torch.randn(64, x.shape[-1]).bfloat16()
        assert torch.equal(
            torch.ops.citer.linear_bf16_amx(x, w, None), torch.ops.citer.linear_bf16(x, w, None)
        )
    x = torch.randn(3, 100).bfloat16()  # cpu_linear sends such a call to the blocks (up to MAX_ROWS) itself
    w = torch.randn(64, 100).bfloat16()
    assert torch.equal(cpu_linear.linear(x, w), torch.ops.citer.linear_bf16(x, w, None))
    cpu_linear.use_amx(False)
    try:
        x = torch.randn(8, 64).bfloat16()
        assert (
            cpu_linear.bf16_kernel(x) is None and cpu_linear.bf16_kernel(x[:4]) is torch.ops.citer.linear_bf16
        )
    finally:
        cpu_linear.use_amx(True)
    assert cpu_linear.bf16_kernel(x) is torch.ops.citer.linear_bf16_amx


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6], ids=["blocks", "amx"])
def test_a_compiled_graph_calls_the_kernel(rows):
    """One row: the vdpbf16ps blocks; six: the AMX tiles (skipped on a CPU without them)."""
    if rows > 1 and not cpu_linear.amx():
        pytest.skip("no AMX here (or Linux refused its state)")
    torch.manual_seed(1)
    x, w = torch.randn(rows, 576).bfloat16(), torch.randn(300, 576).bfloat16()
    fn = torch.compile(lambda x, w: cpu_linear.linear(x, w) * 2, fullgraph=True, backend="aot_eager")
    op = torch.ops.citer.linear_bf16 if rows == 1 else torch.ops.citer.linear_bf16_amx
    assert torch.equal(fn(x, w), op(x, w, None) * 2)


def test_other_calls_are_torchs_linear_exactly():
    torch.manual_seed(2)
    w32, x32 = torch.randn(64, 96), torch.randn(2, 96)
    assert torch.equal(cpu_linear.linear(x32, w32), F.linear(x32, w32))  # float32
    x, w = torch.randn(cpu_linear.AMX_MAX_ROWS + 1, 96).bfloat16(), torch.randn(64, 96).bfloat16()
    assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))  # more rows than the kernel takes


@needs_bf16
@pytest.mark.parametrize(
    ("shape", "bias"),
    [
        ((cpu_linear.AMX_MAX_ROWS + 1, 576), False),
        ((cpu_linear.AMX_MAX_ROWS // 8 + 1, 8, 96), True),
        ((cpu_linear.PACKED_MAX_ROWS, 64), True),
    ],
)
def test_more_rows_take_the_packed_weight_with_torchs_products(shape, bias):
    torch.manual_seed(3)
    x, w = torch.randn(*shape).bfloat16(), torch.randn(200, shape[-1]).bfloat16()
    b = torch.randn(200).bfloat16() if bias else None
    with torch.inference_mode():
        got = cpu_linear.linear(x, w, b)
    assert w in cpu_linear._packed  # the packed path ran
    assert torch.equal(got, F.linear(x, w, b))


@needs_bf16
def test_a_weight_changed_in_place_is_packed_again():
    torch.manual_seed(4)
    x, w = torch.randn(cpu_linear.AMX_MAX_ROWS + 8, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    first = cpu_linear.linear(x, w)
    w.mul_(2)
    assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    assert not torch.equal(cpu_linear.linear(x, w), first)
    with torch.inference_mode():  # an inference tensor has no version counter: packed once, read as made
        wi = torch.randn(32, 64).bfloat16()
        assert torch.equal(cpu_linear.linear(x, wi), F.linear(x, wi)) and wi in cpu_linear._packed


def test_training_and_big_products_keep_torchs_linear():
    torch.manual_seed(5)
    w = torch.randn(16, 64).bfloat16().requires_grad_()
    x = torch.randn(8, 64).bfloat16()
    y = cpu_linear.linear(x, w)
    y.sum().backward()  # autograd runs through F.linear, not the packed op
    assert w.grad is not None and w not in cpu_linear._packed
    big = torch.randn(cpu_linear.PACKED_MAX_ROWS + 1, 64).bfloat16()
    w2 = torch.randn(16, 64).bfloat16()
    assert torch.equal(cpu_linear.linear(big, w2), F.linear(big, w2)) and w2 not in cpu_linear._packed


@pytest.fixture
def fp32_packed(monkeypatch):
    """The float32 path switched on whatever this CPU's vendor (its gate is tested on its own below), so its
    arithmetic is checked on Intel machines too."""
    monkeypatch.setattr(cpu_linear, "_state", {**cpu_linear._state, "fp32": True})


@pytest.mark.parametrize(
    ("vendor", "switch", "packed"),
    [
        ("AuthenticAMD", "1", True),
        ("GenuineIntel", "1", False),
        ("", "1", False),
        ("AuthenticAMD", "0", False),
    ],
)
def test_float32_path_is_gated_on_an_amd_cpu_and_the_switch(monkeypatch, vendor, switch, packed):
    monkeypatch.setattr(cpu_linear, "host_cpu", lambda: HostCpu(vendor=vendor, model="m", flags=frozenset()))
    monkeypatch.setenv("CITER_CPU_LINEAR", switch)
    monkeypatch.setattr(cpu_linear, "_state", {})  # the process's own answers stay as they were
    assert cpu_linear._fp32_packed() is (packed and torch.backends.mkldnn.is_available())
    cpu_linear.use_float32_packed(False)
    assert cpu_linear._fp32_packed() is False


@needs_mkldnn
@pytest.mark.usefixtures("fp32_packed")
@pytest.mark.parametrize("bias", [False, True])
def test_float32_over_a_big_weight_takes_the_packed_weight(bias):
    torch.manual_seed(6)
    w = torch.randn(cpu_linear.FP32_PACKED_MIN // 256, 256)  # exactly the threshold
    b = torch.randn(w.shape[0]) if bias else None
    n = cpu_linear.F32_MAX_ROWS + 8  # more rows than the kernel takes
    x = torch.randn(n, 256)
    with torch.inference_mode():
        got = cpu_linear.linear(x, w, b)
        # (1, n - 1, in): a row's products whatever the shape around it
        others = cpu_linear.linear(x[None, 1:], w, b)
    assert w in cpu_linear._packed
    assert _close(got, x, w, b) < 1e-5  # float32 sums in another order
    assert torch.equal(others[0, 2], got[3])


def _f32_kernel_buildable() -> bool:
    """An x86 CPU with AVX2 and FMA, a C++ compiler and ninja: where the AVX2 kernel must build."""
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    cpu = cpu_linear.host_cpu()
    return cpu.has("avx2") and cpu.has("fma") and bool(shutil.which("c++")) and is_ninja_available()


needs_f32_kernel = pytest.mark.skipif(
    not _f32_kernel_buildable(), reason="no AVX2 and FMA, no C++ compiler or no ninja here"
)


@needs_mkldnn
@needs_f32_kernel
@pytest.mark.usefixtures("fp32_packed")
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [
        (1, 576, 1536, False),
        (3, 1029, 128, True),
        (cpu_linear.F32_MAX_ROWS, 515, 301, True),
        (2, 13, 10091, False),
        (8, 517, 203, True),
    ],
)
def test_float32_few_rows_take_the_kernel(rows, n, k, bias):
    """Widths that are not a multiple of the kernel's 8 columns (a masked tail) nor its 8 weight rows, a bias; every
    row's outputs the same alone as beside the others."""
    assert cpu_linear.f32_available(), "the AVX2 kernel did not build here"
    torch.manual_seed(8)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(1, rows, k)
    with torch.inference_mode():
        got = cpu_linear.linear(x, w, b) if w.numel() >= cpu_linear.FP32_PACKED_MIN else None
        direct = torch.ops.citer.linear_f32(x, w, b)
        alone = [torch.ops.citer.linear_f32(x[:, i : i + 1], w, b) for i in range(rows)]
    assert got is None or (torch.equal(got, direct) and w not in cpu_linear._packed)  # what the forwards call
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert ((direct.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert all(torch.equal(a[:, 0], direct[:, i]) for i, a in enumerate(alone))


@needs_mkldnn
@needs_f32_kernel
def test_the_float32_kernel_is_only_asked_for_where_its_gate_holds(monkeypatch):
    """Off the AMD gate (or with the switch off) a float32 call never builds or calls the kernel."""
    monkeypatch.setattr(cpu_linear, "_state", {"fp32": False})
    w, x = torch.randn(cpu_linear.FP32_PACKED_MIN // 256, 256), torch.randn(2, 256)
    with torch.inference_mode():
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    assert not cpu_linear.f32_available() and "built_f32" not in cpu_linear._state


@needs_mkldnn
@pytest.mark.usefixtures("fp32_packed")
def test_float32_small_weights_and_training_keep_torchs_linear():
    torch.manual_seed(7)
    w = torch.randn(cpu_linear.FP32_PACKED_MIN // 256 - 1, 256)  # one row below the threshold
    x = torch.randn(8, 256)
    with torch.inference_mode():
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w)) and w not in cpu_linear._packed
    big = torch.randn(cpu_linear.FP32_PACKED_MIN // 256, 256, requires_grad=True)
    cpu_linear.linear(x, big).sum().backward()  # autograd runs through F.linear
    assert big.grad is not None and big not in cpu_linear._packed
    # A frozen weight under an input or bias that needs gradients: neither the kernel nor the packed weight (no
    # backward), whatever the rows
    frozen = torch.randn(cpu_linear.FP32_PACKED_MIN // 256, 256)
    for rows in (2, cpu_linear.F32_MAX_ROWS + 1):
        xg = torch.randn(rows, 256, requires_grad=True)
        bg = torch.zeros(frozen.shape[0], requires_grad=True)
        assert cpu_linear.float32_path(xg, frozen) == cpu_linear.float32_path(x, frozen, bg) == "torch"
        cpu_linear.linear(xg, frozen, bg).sum().backward()
        assert torch.allclose(xg.grad, frozen.sum(0).expand(rows, -1), rtol=1e-4, atol=1e-3) and torch.equal(
            bg.grad, torch.full_like(bg, rows)
        )
    assert frozen not in cpu_linear._packed
