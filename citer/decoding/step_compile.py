"""Compiling the fixed-shape step's pieces, one layer and the head, once per model and call kind
(:mod:`citer.decoding.static_step` runs it).

A call is ``B`` rows of ``Q`` tokens over the whole slot pool (``R`` slots, ``K = capacity + 1`` columns, the last a
trash column that pad tokens write to and no query attends). ``B``, ``Q`` and ``R`` are symbols of the compiled graph
(``mark_dynamic``, sizes treated obliviously so that 1 is not special; nothing in the traced bodies merges a symbolic
size with another dimension, which would guard on it being 1); only ``K`` is static. So a model compiles its pieces once per
call kind, whatever the batch, as nano-vllm and vLLM compile once and capture per batch size. Each model compiles
code objects of its own (:func:`own_code`), so the SLM and the LLM share neither graphs nor the recompile limit, and
a router or τ is never a constant of a forward graph: the step's decision (:func:`~citer.decoding.decide.decide`) is traced apart.

A model compiles one decoder layer and the head, called layer by layer (regional compilation: a compile costs one
layer's trace whatever the depth; a captured step replays without the Python loop). Everything a step reads from outside is
marked a static address once (:func:`mark_static`): weights, norms, RoPE tables, the pools, the input buffers, so a
CUDA graph never copies one at replay. A compile that fails, or a model that compiles more than
:data:`RECOMPILE_LIMIT` graphs of one piece, falls back to eager steps with one warning.
Shapes: B = rows, Q = tokens per row, R = pool slots, K = capacity + 1, H = hidden, V = vocab, kv/D = heads/head_dim.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from citer.decoding.compiled import own_code
from citer.decoding.cpu_linear import linear
from citer.decoding.kv_pool import PoolCall
from citer.decoding.lean import LeanDecoder, decoder_layer

# A model's step should compile once per call kind; more graphs than this for one code object means shapes leak into
# guards, and the step falls back to eager with a warning rather than compile without end.
RECOMPILE_LIMIT = 8


@dataclass(frozen=True)
class StepMode:
    """How fixed-shape steps run, rows and tokens padded to powers of two (buckets). ``backend``: None runs them
    eagerly, else a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, or a callable) compiling one layer and
    the head. ``graphs``: fixed input buffers and one capture per bucket (CUDA graphs on CUDA)."""

    backend: str | Callable[..., Any] | None = None
    graphs: bool = False


@dataclass
class StepStats:
    """What a model's fixed-shape steps cost to prepare, in this process: compiles of its forward (the seconds of the
    calls that compiled, tracing included, and of the backend alone), traces of decisions, captures (and their seconds), re-captures after a pool moved, and eager
    fallbacks."""

    compiles: int = 0
    compile_s: float = 0.0
    backend_s: float = 0.0
    decision_traces: int = 0
    captures: int = 0
    capture_s: float = 0.0
    recaptures: int = 0
    fallbacks: int = 0
    buckets: set[tuple[int, int]] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "compiles": self.compiles,
            "compile_s": round(self.compile_s, 2),
            "backend_s": round(self.backend_s, 2),
            "decision_traces": self.decision_traces,
            "captures": self.captures,
            "capture_s": round(self.capture_s, 3),
            "recaptures": self.recaptures,
            "fallbacks": self.fallbacks,
            "buckets": sorted(self.buckets),
        }


@dataclass(frozen=True)
class StepKind:
    """A call kind: ``prefix`` rows are the slots 0..B-1 (read as a slice, not gathered); ``q1``: one token per row
    (Q static); ``every``: logits at every position; ``fused``: one-query attention as fused products (CPU)."""

    prefix: bool
    q1: bool
    every: bool
    fused: bool


# -- the traced bodies: the lean forward's own (LeanDecoder.hidden, lean.decoder_layer) over the fixed buffers ------
class FixedPool:
    """A fixed-shape call's K/V buffers, per layer the pool's (R, kv, K, D): what ``LeanDecoder.hidden`` asks a pool
    for (the list, not the pool, so a traced step reads plain tensors)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]


def head_step(
    h: torch.Tensor, head: torch.Tensor, last: torch.Tensor, kind: StepKind
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over the final norm's output h (B, Q, H): logits (B, V) and hidden (B, H) at each row's ``last`` (B,)
    token, or (``every``) (B, Q, V) and (B, Q, H)."""
    if kind.every:
        return linear(h, head), h
    if kind.q1:
        h = h[:, 0]
    else:
        h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]  # (B, H)
    return linear(h, head), h


def step_body(
    lean: LeanDecoder,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids: torch.Tensor,
    pos: torch.Tensor,
    cols: torch.Tensor,
    tok_slot: torch.Tensor,
    slots: torch.Tensor,
    last: torch.Tensor,
    kind: StepKind,
    layer: Callable[..., torch.Tensor] | None = None,
    head: Callable[..., tuple[torch.Tensor, torch.Tensor]] = head_step,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed-shape call: ids, pos, cols, tok_slot (B, Q) long; slots (B,) the rows' pool slots; last (B,) the index
    of each row's last real token. keys/values: per layer the pool (R, kv, K, D). The model's one body
    (``LeanDecoder.hidden``): each layer writes its K/V at (tok_slot, cols) and attends the rows' whole pool rows
    (the prefix's as a slice, named slots gathered) under the causal mask of the positions. Run eagerly, ``layer``
    (:func:`~citer.decoding.lean.decoder_layer`) and ``head`` compiled or not."""
    k_cols = keys[0].shape[2]
    mask = torch.arange(k_cols, device=pos.device) <= pos[:, None, :, None]  # (B, 1, Q, K)
    call = PoolCall(k_cols, rows=tok_slot, cols=cols, slots=None if kind.prefix else slots)
    attention = "fused" if kind.fused else "grouped"
    h = lean.hidden(ids, pos, mask, FixedPool(keys, values), call, k_cols, attention, layer)  # (B, Q, H)
    return head(h, lean.head, last, kind)


def mark_static(t: torch.Tensor) -> None:
    """Mark ``t`` a static address (once; no identity guard, so the layers of a model share one compiled layer)."""
    if getattr(t, "_dynamo_static_input_type", None) is None:
        torch._dynamo.mark_static_address(t, guard=False)


# The symbolic dims of decoder_layer's tensors: x, cos, sin, mask, kb, vb, then the call's rows, cols and slots.
_LAYER_DIMS = ((0, 1), (0, 1), (0, 1), (0, 2), (0,), (0,), (0, 1), (0, 1), (0,))


def mark_dims(t: torch.Tensor, *dims: int) -> torch.Tensor:
    for d in dims:
        torch._dynamo.mark_dynamic(t, d)
    return t


# -- one model's compiled pieces ------------------------------------------------------------------------------------
class CompiledPieces:
    """A model's compiled step pieces for one mode, shared by every engine over that model (compiles are per model and
    call kind, not per engine): keyed by (piece, kind)."""

    def __init__(self, lean: LeanDecoder, mode: StepMode, stats: StepStats) -> None:
        self.lean, self.mode, self.stats = lean, mode, stats
        self._fns: dict[tuple[str, StepKind], Callable[..., Any]] = {}
        self.eager_only = False  # set after a compile failed: every call runs eagerly from then on

    def _backend(self) -> Callable[..., Any]:
        """The mode's backend, counting and timing the compiles it is asked for."""
        mode, stats = self.mode, self.stats

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            t = time.perf_counter()
            if mode.backend == "inductor":
                from torch._inductor.compile_fx import compile_fx

                # The C++ wrapper calls the kernels without a Python frame each: measured faster on the CPU step.
                cpu = {} if self.lean.embed.is_cuda else {"cpp_wrapper": True}
                out = compile_fx(gm, example_inputs, config_patches=cpu)
            elif callable(mode.backend):
                out = mode.backend(gm, example_inputs)
            else:
                out = torch._dynamo.lookup_backend(mode.backend)(gm, example_inputs)
            stats.compiles += 1
            stats.backend_s += time.perf_counter() - t
            return out

        return compile_graph

    def fn(self, piece: str, kind: StepKind) -> Callable[..., Any]:
        """The compiled ``piece`` ("layer" or "head") for ``kind``."""
        key = (piece, kind)
        got = self._fns.get(key)
        if got is None:
            body = {"layer": decoder_layer, "head": head_step}[piece]
            flags = "".join("1" if getattr(kind, f) else "0" for f in ("prefix", "q1", "every", "fused"))
            own = own_code(body, f"{id(self.lean):x}_{flags}")
            got = self._fns[key] = torch.compile(own, fullgraph=True, dynamic=None, backend=self._backend())
        return got

    def forward(self, args: tuple[Any, ...], kind: StepKind) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed-shape call (:func:`step_body`'s arguments) through the compiled pieces, or eagerly after a compile
        failed (warned once: the first failure switches this model's steps in this mode to eager)."""
        c = self
        if c.eager_only:
            return step_body(*args)
        t0, n0 = time.perf_counter(), self.stats.compiles
        try:
            with compile_context():
                out = step_body(*args, layer=self._regional("layer", kind), head=self._regional("head", kind))
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as err:
            # Raised tracing or compiling, before the graph ran; a rerun writes the same K/V to the same columns.
            c.eager_only = True
            self.stats.fallbacks += 1
            warnings.warn(
                f"fixed-shape steps cannot be compiled here ({err}); running them eagerly", stacklevel=4
            )
            return step_body(*args)
        if self.stats.compiles > n0:  # a call that compiled: its seconds, trace and first run included
            self.stats.compile_s += time.perf_counter() - t0
        return out

    def _regional(self, piece: str, kind: StepKind) -> Callable[..., Any]:
        """A compiled piece whose arguments' symbolic dims are marked at every call (a recompile, after the pool's
        columns grew, keeps rows and tokens symbols)."""
        fn = self.fn(piece, kind)

        def call(*a: Any) -> Any:
            # layer: x, cos, sin, mask, L, shape, the pool (kb, vb), the call (its indices), attention
            if piece == "layer":
                pc = a[8]
                tensors = (*a[:4], a[6], a[7], pc.rows, pc.cols, pc.slots)
                for t, dims in zip(tensors, _LAYER_DIMS, strict=True):
                    if t is not None:  # slots: None for the prefix
                        mark_dims(t, *dims)
            else:  # h (B, Q, H), head, last (B,), kind
                mark_dims(a[0], 0, 1)
                mark_dims(a[2], 0)
            return fn(*a)

        return call


_COMPILED: weakref.WeakKeyDictionary[LeanDecoder, dict[StepMode, CompiledPieces]] = (
    weakref.WeakKeyDictionary()
)
_STATS: weakref.WeakKeyDictionary[LeanDecoder, StepStats] = weakref.WeakKeyDictionary()


def step_stats(lean: LeanDecoder) -> StepStats:
    """The fixed-shape step counts of one model's lean decoder in this process."""
    got = _STATS.get(lean)
    if got is None:
        got = _STATS[lean] = StepStats()
    return got


def compiled_pieces(lean: LeanDecoder, mode: StepMode) -> CompiledPieces:
    per = _COMPILED.setdefault(lean, {})
    got = per.get(mode)
    if got is None:
        got = per[mode] = CompiledPieces(lean, mode, step_stats(lean))
    return got


def compile_context() -> ExitStack:
    """What a compiled step runs under: sizes treated obliviously (a row count of 1 is a value, not a new graph) and a
    recompile limit per code object that raises instead of silently running eagerly."""
    stack = ExitStack()
    stack.enter_context(fx_config.patch(backed_size_oblivious=True))
    stack.enter_context(
        torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)
    )
    return stack
