"""One decoder layer's arithmetic as plain tensor ops, for the families the lean forward covers (Qwen2/Qwen2.5,
Llama 3.x, Qwen3, Mistral without a window): the weights a layer reads, the norm, RoPE's rotation, the attention's
input and output halves, and two forms of the attention itself. :mod:`citer.decoding.lean` runs them over an HF
model's own weights; :mod:`citer.decoding.static_step` traces them into fixed-shape steps. An eager bf16 call on a
CPU runs the norm, RoPE's rotation and the gate as one C++ pass each (the decode step's ops, row by row:
:func:`~citer.kernels.cpu_linear.row_ops`), where torch's ops would make several passes over a prompt's activations.
Shapes: B = rows, T/Q = tokens per row, H = hidden, nh/kv = query/key-value heads, D = head_dim, K = key columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from citer.kernels.cpu_linear import linear, row_ops


@dataclass
class LayerWeights:
    """One decoder layer's weights: views of an HF layer's parameters, q/k/v and gate/up each fused into one matrix
    (``lean._fuse``), so both forwards read the same memory."""

    ln1: torch.Tensor  # (H,)
    ln2: torch.Tensor  # (H,)
    wqkv: torch.Tensor  # ((nh + 2 kv) D, H)
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None  # (D,) Qwen3's per-head norms
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # (H, nh D)
    bo: torch.Tensor | None
    wgu: torch.Tensor  # (2 I, H)
    bgu: torch.Tensor | None
    wd: torch.Tensor  # (H, I)
    bd: torch.Tensor | None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm."""
    if x.dtype == torch.float32:  # one fused op; in float32 the same arithmetic as HF's RMSNorm
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if row_ops(x, w):  # one pass over x, not five over a float32 copy; the sum of squares in another order
        return torch.ops.citer.rms_norm_bf16(x, w, eps)
    # As HF's RMSNorm: statistics in float32 (the fused op is HF's arithmetic there, as above), the weight applied in
    # the input dtype.
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` in four ops, not seven: rotate_half(x) = cat(-x2, x1) and
    cat(-x2, x1) * sin = roll(x, D/2) * cat(-sin1, sin2), the sign moved onto the table (an exact negation). x (B, T,
    n, D), cos and signed_sin (B, T, 1, D) (or any leading dims so); a bf16 call takes the extension's one pass where
    :func:`~citer.kernels.cpu_linear.row_ops` allows (the same three roundings: the same bits)."""
    d = x.shape[-1]
    # row_ops first: false while compiling, so a traced forward never guards on the layout checks after it
    if row_ops(x) and x.dim() > 2 and d <= 512 and x.stride(-1) == 1 and x.stride(-2) == d:
        if cos.shape == (*x.shape[:-2], 1, d):
            # a view where x's rows are evenly strided (a projection's heads)
            rows, c, s = x.reshape(-1, x.shape[-2], d), cos.reshape(-1, d), signed_sin.reshape(-1, d)
            return torch.ops.citer.rope_bf16(rows, c, s).view(x.shape)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    flat: bool = False,
) -> torch.Tensor:
    """q (B, nh, Q, D), k/v (B, kv, K, D), mask (B, 1, Q, K) -> (B, nh, Q, D) (``flat``: (B, Q, nh D), the output
    projection's input, written in that layout rather than copied into it), as products and sums a compiler fuses
    into a few loops (eagerly they would be materialized: for compiled code only). On a CPU the library kernel's cost
    is mostly per-row setup, which fusing avoids. And nothing here merges a symbolic size with another dimension,
    which a batched matrix product does (a guard on rows or tokens being 1): the fixed-shape steps compile it once for
    every B and Q."""
    b, nh, n_q, d = q.shape
    kv = k.shape[1]
    qg = q.view(
        b, kv, nh // kv, n_q, 1, d
    )  # query heads grouped by the key head they read (a view: no merge)
    s = (qg * k[:, :, None, None]).sum(-1) * scale  # (B, kv, g, Q, K)
    if mask is not None:
        m = mask[:, :, None]  # (B, 1, 1, Q, K)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    p = s.softmax(-1)  # (B, kv, g, Q, K)
    if flat:
        return (p.permute(0, 3, 1, 2, 4)[..., None] * v[:, None, :, None]).sum(-2).view(b, n_q, nh * d)
    return (p[..., None] * v[:, :, None, None]).sum(-2).view(b, nh, n_q, d)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (B, nh, Q, D), k/v (B, kv, K, D), mask (B, 1, Q, K) bool (True = attend) -> (B, nh, Q, D), as two batched
    matrix products: a key head's query heads stacked along the query axis, so K/V are read once per key head and
    never repeated. The fixed-shape steps use it because it compiles for symbolic B and Q on every backend (the CPU's
    fused attention kernel does not lower with symbolic sizes)."""
    b, nh, n_q, d = q.shape
    kv, n_k = k.shape[1], k.shape[2]
    g = nh // kv
    s = q.reshape(b, kv, g * n_q, d) @ k.transpose(-1, -2) * scale  # (B, kv, g Q, K)
    s = s.view(b, kv, g, n_q, n_k).masked_fill(~mask[:, :, None], float("-inf"))
    p = s.softmax(-1).view(b, kv, g * n_q, n_k)
    return (p @ v).view(b, nh, n_q, d)


@dataclass(frozen=True)
class HeadShape:
    """A decoder's attention shape, softmax scale and norm epsilon: constants of every traced layer (one object per
    model, so a compiled layer guards on it once)."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    scale: float  # the attention's softmax scale


def attn_in(
    x: torch.Tensor, L: LayerWeights, s: HeadShape, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's attention inputs: x (B, T, H) -> q (B, nh, T, D), k and v (B, kv, T, D), rotated at the positions
    of ``cos``/``sin`` (B, T, 1, D)."""
    b, t = x.shape[0], x.shape[1]
    nh, nkv, d = s.n_heads, s.n_kv, s.head_dim
    qkv = linear(rms_norm(x, L.ln1, s.eps), L.wqkv, L.bqkv).view(b, t, nh + 2 * nkv, d)
    if L.q_norm is not None:  # Qwen3: a norm per head before RoPE
        qk = torch.cat(
            (rms_norm(qkv[:, :, :nh], L.q_norm, s.eps), rms_norm(qkv[:, :, nh : nh + nkv], L.k_norm, s.eps)),  # type: ignore[arg-type]
            dim=2,
        )
    else:
        qk = qkv[:, :, : nh + nkv]
    qk = rotate(qk, cos, sin)  # (B, T, nh + kv, D): queries and keys in one rotation
    return qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + nkv :].transpose(1, 2)


def attn_out_mlp(x: torch.Tensor, o: torch.Tensor, L: LayerWeights, eps: float) -> torch.Tensor:
    """The rest of a layer: x (B, T, H) plus the output projection of the attention o (B, T, nh D), then the gated
    MLP's residual."""
    x = x + linear(o, L.wo, L.bo)
    return x + linear(silu_mul(linear(rms_norm(x, L.ln2, eps), L.wgu, L.bgu)), L.wd, L.bd)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """The gated MLP's ``F.silu(g) * u`` of gu (..., 2 I) = (g, u) -> (..., I); a bf16 call takes the extension's one
    pass where :func:`~citer.kernels.cpu_linear.row_ops` allows (rounded where the two ops round; its exp is not
    torch's, so about one element in 3,000 differs in the last bit)."""
    if row_ops(gu):
        return torch.ops.citer.silu_mul_bf16(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u
