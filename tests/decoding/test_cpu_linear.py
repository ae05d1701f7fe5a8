"""The bf16 CPU linear kernel (citer.decoding.cpu_linear): the same products as torch's linear up to bf16 rounding, for
one to four rows, any width (a masked tail), with and without bias, eagerly and inside a compiled graph; everything
else is torch's linear, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from citer.decoding import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX512-BF16 or no compiler here")


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


@needs_kernel
def test_a_compiled_graph_calls_the_kernel():
    torch.manual_seed(1)
    x, w = torch.randn(2, 576).bfloat16(), torch.randn(300, 576).bfloat16()
    fn = torch.compile(lambda x, w: cpu_linear.linear(x, w) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x, w), torch.ops.citer.linear_bf16(x, w, None) * 2)


def test_other_calls_are_torchs_linear_exactly():
    torch.manual_seed(2)
    w32, x32 = torch.randn(64, 96), torch.randn(2, 96)
    assert torch.equal(cpu_linear.linear(x32, w32), F.linear(x32, w32))  # float32
    x, w = torch.randn(cpu_linear.MAX_ROWS + 1, 96).bfloat16(), torch.randn(64, 96).bfloat16()
    assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))  # more rows than the kernel takes
