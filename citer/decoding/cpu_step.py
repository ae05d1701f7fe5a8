"""A decode step's layer on the CPU in a few C++ calls (:func:`decode_layer`), or all its layers in one.

Once the linears stream their weights (``cpu_linear``'s kernels), a small model's eager decode step on a CPU is bound
by its op count: the norms, RoPE, the KV write, the attention and the MLP's gate take ~20 torch ops a layer at a few
microseconds each. The step ops do them in three: the RMS norm, one token a row's attention (RoPE on its query and
key, the key and value written to the pool, the row's columns attended) and silu(gate) * up; in float32
``cpu_step_f32.cpp`` (AVX2, built into the float32 kernel's extension), in bf16 ``cpu_step_bf16.cpp`` (AVX-512, built
into the bf16 kernel's), which rounds to bf16 where the lean forward's torch ops do. Each row is computed alone, so a
row's outputs do not depend on the rows beside it; they differ from torch's ops in the last bits (other summation
orders, another exp).

In bf16, where one kernel takes every product of the step, the whole stack of layers runs in one C++ call
(:func:`decode_stack`, ``citer::decode_layers_bf16``: the same ops in the same order, so the same bits), saving the
Python and dispatch around a step's ~300 op calls.

:func:`step_for` says which calls take them: decode steps (one new token a row, over a pool,
not packed) of a model whose fused q/k/v weight has at least :data:`MIN_WEIGHT` elements (the pipeline's tiny models
keep torch's ops bit for bit), whose heads have no per-head norms (Qwen3 keeps torch's), in float32 where its one-row
linears take the AVX2 kernel (an AMD CPU; heads a multiple of 8 wide) and in bf16 where the AVX512-BF16 kernel serves.
Shapes: B = rows, H = hidden, nh/kv = query/key-value heads, D = head_dim, K = key columns.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from citer.decoding.kv_pool import PoolCall
from citer.decoding.layers import HeadShape, LayerWeights
from citer.kernels import cpu_linear

# Elements of a layer's fused q/k/v weight from which its decode steps take the step ops (float32's kernel takes no
# smaller weight either): below, a step's op count is not what bounds it, and torch's ops keep their bits.
MIN_WEIGHT = cpu_linear.FP32_PACKED_MIN
# Keys a call's queries read in all (each token its row's columns up to its own), up to which its chunks run as a bf16
# decode step of their tokens (:func:`tokens_as_step`): each query then reads its row's keys alone, where the library
# kernel reads them once for a block of queries, but the kernel's call per run of slots per layer, the pool's scatter
# and the layer's separate norm and RoPE passes go (the bound measured in docs/results.md).
TOKEN_STEP_KEYS = 8192


@dataclass(frozen=True)
class StepOps:
    """The step ops of one dtype (``torch.ops.citer``'s, looked up once)."""

    rms_norm: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]


@functools.cache
def step_ops(dtype: torch.dtype) -> StepOps:
    """The step ops for ``dtype`` (float32 or bfloat16); their extension must be loaded."""
    ops = torch.ops.citer
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    return StepOps(
        getattr(ops, f"rms_norm_{name}"),
        getattr(ops, f"decode_attention_{name}"),
        getattr(ops, f"silu_mul_{name}"),
    )


def _kernel(w: torch.Tensor, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The few-row kernel op ``linear(x, w)`` runs in ``w``'s dtype, or None (another path)."""
    if w.dtype is torch.float32:
        return torch.ops.citer.linear_f32 if cpu_linear.float32_path(x, w) == "kernel" else None
    return cpu_linear.bf16_kernel(x)


def _model_takes_step_ops(lean: Any) -> bool:
    """The checks of the model and the moment that every call taking the step ops passes: the ops are on, no
    autograd (the ops have no backward, and write the pool without bumping its version), and the layers' weights
    sit on the CPU, hold at least :data:`MIN_WEIGHT` elements and have no per-head norms (module docstring)."""
    L = lean.layers[0]
    return (
        cpu_linear.step_ops_on()
        and not torch.is_grad_enabled()
        and L.wqkv.numel() >= MIN_WEIGHT
        and L.q_norm is None
        and L.wqkv.device.type == "cpu"
    )


def _plan(
    lean: Any, ids: torch.Tensor, mask: torch.Tensor | None, pool: Any, call: PoolCall | None
) -> tuple[StepOps, Callable[..., torch.Tensor] | None] | None:
    """(the step ops, the one kernel every product takes or None) where this call may take the step ops (module
    docstring), else None."""
    if ids.shape[1] != 1 or pool is None or call is None or not _model_takes_step_ops(lean):
        return None
    if call.varlen is not None or call.keys is not None:  # packed
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    L = lean.layers[0]
    one_row = L.wqkv.new_empty((1, L.wqkv.shape[1]))
    if L.wqkv.dtype is torch.float32:
        if lean.head_dim % 8 or cpu_linear.float32_path(one_row, L.wqkv) != "kernel":
            return None
    elif L.wqkv.dtype is not torch.bfloat16 or not cpu_linear.available():
        return None
    weights = (L.wqkv, L.wo, L.wgu, L.wd)
    rows = L.wqkv.new_empty((ids.shape[0], max(w.shape[1] for w in weights)))
    kernels = {_kernel(w, rows[:, : w.shape[1]]) for w in weights}
    return step_ops(L.wqkv.dtype), (kernels.pop() if len(kernels) == 1 else None)


def tokens_as_step(lean: Any, keys: int) -> bool:
    """Whether a call over a pool whose queries read ``keys`` keys in all runs as a decode step of its tokens
    (:func:`~citer.decoding.context.prepare`'s ``tokens``): a bf16 CPU model the step ops take, without autograd,
    and ``keys`` within :data:`TOKEN_STEP_KEYS`. float32 keeps the library kernel's attention (its sums, so the
    pipeline's records, stay as they were)."""
    return (
        keys <= TOKEN_STEP_KEYS
        and _model_takes_step_ops(lean)
        and lean.layers[0].wqkv.dtype is torch.bfloat16
        and cpu_linear.available()
    )


def step_for(
    lean: Any,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    pool: Any,
    call: PoolCall | None,
    stack: bool = True,
) -> tuple[Callable[..., torch.Tensor] | None, Callable[..., torch.Tensor] | None]:
    """(layer, stack) for this call, at most one of them set: :func:`decode_stack` where the call may take the step
    ops in bf16 with every product on one kernel (and ``stack``), else :func:`decode_layer` where it may take the step
    ops (module docstring), else neither (the lean forward's own layers)."""
    plan = _plan(lean, ids, mask, pool, call)
    if plan is None:
        return None, None
    ops, kernel = plan
    if kernel is None:
        return functools.partial(decode_layer, ops=ops), None
    if stack and lean.layers[0].wqkv.dtype is torch.bfloat16:
        return None, functools.partial(
            decode_stack, lean=lean, tiles=kernel is torch.ops.citer.linear_bf16_amx
        )
    # every linear on one kernel: called directly, without cpu_linear's checks at each of a step's calls
    return functools.partial(decode_layer, ops=ops, linear=kernel), None


_STACK_WEIGHTS: weakref.WeakKeyDictionary[Any, list[torch.Tensor | None]] = weakref.WeakKeyDictionary()


def _stack_weights(lean: Any) -> list[torch.Tensor | None]:
    """The lean decoder's layer weights as ``decode_layers_bf16`` takes them, 10 a layer (built once: they are
    static)."""
    got = _STACK_WEIGHTS.get(lean)
    if got is None:
        got = _STACK_WEIGHTS[lean] = [
            t
            for L in lean.layers
            for t in (L.ln1, L.wqkv, L.bqkv, L.wo, L.bo, L.ln2, L.wgu, L.bgu, L.wd, L.bd)
        ]
    return got


def decode_stack(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    pool: Any,
    call: PoolCall,
    lean: Any,
    tiles: bool,
) -> torch.Tensor:
    """Every layer of a bf16 decode step in one C++ call (``citer::decode_layers_bf16``): :func:`decode_layer` with
    the bf16 step ops and one kernel, layer after layer, the same ops in the same order (so the same bits) without a
    Python call around each of a step's ~300 ops. x (B, 1, H); cos, sin (B, 1, 1, D); mask (B, 1, 1, K) bool or None;
    ``tiles``: the products on the AMX tiles' op (2-32 rows), else the one-row blocks'."""
    assert call.rows is not None and call.cols is not None
    b = x.shape[0]
    kv = [pool.buffers(i, x) for i in range(len(lean.layers))]
    shape = lean.shape
    return torch.ops.citer.decode_layers_bf16(
        x,
        cos.view(b, -1),
        sin.view(b, -1),
        None if mask is None else mask.reshape(b, call.kv_len),
        _stack_weights(lean),
        [k for k, _ in kv],
        [v for _, v in kv],
        call.rows.reshape(b),
        call.cols.reshape(b),
        call.kv_len,
        shape.n_heads,
        shape.n_kv,
        shape.scale,
        shape.eps,
        tiles,
    )


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
    ops: StepOps,
    linear: Callable[..., torch.Tensor] = cpu_linear.linear,
) -> torch.Tensor:
    """:func:`~citer.decoding.lean.decoder_layer` for one new token a row: x (B, 1, H) -> (B, 1, H); cos, sin (B, 1,
    1, D); mask (B, 1, 1, K) bool or None (every column); the new K/V go to kb, vb (R, kv, C, D) at the call's
    (rows, cols). ``ops``: the step ops of x's dtype; ``linear`` runs the layer's products (``cpu_linear.linear``, or
    the kernel where :func:`step_for` found it takes every one)."""
    assert kb is not None and vb is not None and call is not None and call.rows is not None
    assert call.cols is not None
    b = x.shape[0]
    qkv = linear(ops.rms_norm(x, L.ln1, shape.eps), L.wqkv, L.bqkv)  # (B, 1, (nh + 2 kv) D)
    o = ops.attention(
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
    gu = linear(ops.rms_norm(x, L.ln2, shape.eps), L.wgu, L.bgu)  # (B, 1, 2 I)
    return x + linear(ops.silu_mul(gu), L.wd, L.bd)
