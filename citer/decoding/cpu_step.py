"""A float32 decode step's layer on an AMD CPU in a few C++ calls: :func:`decode_layer`.

Once the linears stream their weights (``cpu_linear``'s AVX2 kernel), a small model's eager decode step on a CPU is
bound by its op count: the norms, RoPE, the KV write, the attention and the MLP's gate take ~20 torch ops a layer at a
few microseconds each. ``cpu_step_f32.cpp`` (built into the float32 kernel's extension) does them in three ops: the
RMS norm, one token a row's attention (RoPE on its query and key, the key and value written to the pool, the row's
columns attended) and silu(gate) * up. Each row is computed alone, so a row's outputs do not depend on the rows beside
it; they differ from torch's ops in the last bits (other summation orders, another exp).

:func:`layer_for` says which calls take it: float32 decode steps (one new token a row, over a pool, not packed) of a
model whose one-row linears take the AVX2 kernel (a real-size model on an AMD CPU; the pipeline's tiny models keep
torch's ops bit for bit), whose heads are a multiple of 8 wide and have no per-head norms (Qwen3 keeps torch's).
Shapes: B = rows, H = hidden, nh/kv = query/key-value heads, D = head_dim, K = key columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from citer.decoding import cpu_linear
from citer.decoding.kv_pool import PoolCall
from citer.decoding.layers import HeadShape, LayerWeights


def layer_for(
    lean: Any, ids: torch.Tensor, mask: torch.Tensor | None, pool: Any, call: PoolCall | None
) -> Callable[..., torch.Tensor] | None:
    """:func:`decode_layer` where this call may take it (module docstring), else None (the lean forward's own)."""
    if not cpu_linear.step_ops_on() or ids.shape[1] != 1 or pool is None or call is None:
        return None
    if torch.is_grad_enabled():  # the ops have no backward (and write the pool without bumping its version)
        return None
    if call.varlen is not None or call.keys is not None:  # packed
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    L = lean.layers[0]
    if L.wqkv.dtype is not torch.float32 or L.wqkv.numel() < cpu_linear.FP32_PACKED_MIN:
        return None
    if L.q_norm is not None or lean.head_dim % 8:
        return None
    one_row = L.wqkv.new_empty((1, L.wqkv.shape[1]))
    if cpu_linear.float32_path(one_row, L.wqkv) != "kernel":
        return None
    weights = (L.wqkv, L.wo, L.wgu, L.wd)
    rows = L.wqkv.new_empty((ids.shape[0], max(w.shape[1] for w in weights)))
    if all(cpu_linear.float32_path(rows[:, : w.shape[1]], w) == "kernel" for w in weights):
        # every linear on the kernel: called directly, without cpu_linear's checks at each of a step's calls
        return functools.partial(decode_layer, linear=torch.ops.citer.linear_f32)
    return decode_layer


def decode_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    L: LayerWeights,
    shape: HeadShape,
    kb: torch.Tensor | None,
    vb: torch.Tensor | None,
    call: PoolCall | None,
    attention: str,
    linear: Callable[..., torch.Tensor] = cpu_linear.linear,
) -> torch.Tensor:
    """:func:`~citer.decoding.lean.decoder_layer` for one new token a row: x (B, 1, H) -> (B, 1, H); cos, sin (B, 1,
    1, D); mask (B, 1, 1, K) bool or None (every column); the new K/V go to kb, vb (R, kv, C, D) at the call's
    (rows, cols). ``linear`` runs the layer's products (``cpu_linear.linear``, or the kernel where
    :func:`layer_for` found it takes every one)."""
    assert kb is not None and vb is not None and call is not None and call.rows is not None
    assert call.cols is not None
    b = x.shape[0]
    ops = torch.ops.citer
    qkv = linear(ops.rms_norm_f32(x, L.ln1, shape.eps), L.wqkv, L.bqkv)  # (B, 1, (nh + 2 kv) D)
    o = ops.decode_attention_f32(
        qkv.view(b, -1),
        cos.view(b, -1),
        sin.view(b, -1),
        kb,
        vb,
        call.rows.reshape(b),
        call.cols.reshape(b),
        None if mask is None else mask.reshape(b, call.kv_len),
        call.kv_len,
        shape.n_heads,
        shape.n_kv,
        shape.scale,
    )  # (B, nh D)
    x = x + linear(o.view(b, 1, -1), L.wo, L.bo)
    gu = linear(ops.rms_norm_f32(x, L.ln2, shape.eps), L.wgu, L.bgu)  # (B, 1, 2 I)
    return x + linear(ops.silu_mul_f32(gu), L.wd, L.bd)
