"""The lean forward under ``torch.compile`` (Inductor) with dynamic sizes: :func:`compiled_hidden`.

Why: a decode step of a small model is bound by its op count, not its arithmetic. Inductor fuses the norms, RoPE,
SiLU-gate, cache writes and (CPU) the one-query attention of decode steps into a few C++ loops, calls the library
kernels for the matrix products and multi-token attention, and (CPU) calls it all from a C++ wrapper instead of a
Python one. Compiled, a catch-up packs its rows whenever their chunks differ in length (``ModelRunner.feed``):
packing's scatter and gather fuse away, padding is wasted work. Measured: docs/results.md.

How: each model gets its own compiled copy of ``LeanDecoder.hidden`` (:mod:`citer.decoding.lean`) per call kind (no
cache, decode step, padded or packed catch-up, with or without a mask, named slots or the prefix). ``torch.compile``
keys graphs, guards and the sizes it has seen change on the code object: one shared copy would make the SLM's head
count a symbol once the LLM's differs, and every call would try every kind's guards. A kind's second size recompiles
it with dynamic sizes, which later sizes reuse (sizes 0 and 1 keep graphs of their own). The KV pool's sizes stay
static: a compiled model's pools round their shapes (``KVPool.round_shapes``) and each pool shape gets its own
graphs, faster than graphs with the pool's sizes as symbols.

A decode step of the SLM can also take the next step's decision into its graph (:meth:`CompiledHidden.decided`), as
the fixed-shape steps do; a router the graph cannot hold is warned about once and decided eagerly from then on.

What it changes: fused float32 arithmetic rounds differently from eager, so a near tie can pick the other token.
Hence opt-in (``forward="compiled"``), for long runs where the compile time is paid once. The graphs are the model's
(one :class:`CompiledHidden` per lean decoder), shared by every runner that compiles it; a forward that fails to
compile warns once and runs eagerly from then on.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

from citer.decoding.decide import decide

# Graphs per call kind: a static and a dynamic one per pool shape (and size 1 apart), well under this.
_RECOMPILES = 64
_STATIC_POOLS = 8


def own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own: dynamo keys graphs, guards, seen sizes and the recompile limit on it."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledHidden:
    """``LeanDecoder.hidden`` of one model through its own compiled graphs (module docstring)."""

    def __init__(self, lean: Any) -> None:
        self.lean = lean
        self.failed = False  # a compile failed: the runners over this model run its forward eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILES)
        # The C++ wrapper calls the kernels without a Python frame each (docs/results.md).
        self._options = {} if lean.embed.is_cuda else {"cpp_wrapper": True}
        self._fns: dict[tuple[bool, ...], Callable[..., torch.Tensor]] = {}
        self._decide_fns: dict[bool, Callable[..., Any]] = {}  # decided steps, by "has a mask"
        self._untraceable: weakref.WeakSet[Any] = weakref.WeakSet()  # routers whose trace failed
        self._pools: set[tuple[int, ...]] = set()  # pool shapes compiled for (_mark_static)
        # Decode-step attention as fused products on the CPU (lean.decoder_layer); on a GPU the library kernel.
        self._attention = "sdpa" if lean.embed.is_cuda else "fused_decode"

    def _mark_static(self, pool: torch.Tensor) -> None:
        """Compile for this pool's sizes (graphs with the pool's sizes as symbols run slower). A rounded pool
        (``KVPool.round_shapes``) takes a few shapes in a run; past :data:`_STATIC_POOLS` of them, new pools stay
        symbolic, so a long run never recompiles without end."""
        shape = tuple(pool.shape)
        if shape in self._pools or len(self._pools) < _STATIC_POOLS:
            self._pools.add(shape)
            torch._dynamo.mark_static(pool)

    def _fn(self, kind: tuple[bool, ...]) -> Callable[..., torch.Tensor]:
        """One compiled copy per call kind: a lookup then tries one kind's guards, not every kind's (failed guard
        sets cost every call)."""
        fn = self._fns.get(kind)
        if fn is None:
            tag = f"{id(self.lean):x}_{''.join('1' if k else '0' for k in kind)}"
            body = own_code(type(self.lean).hidden, tag)
            fn = self._fns[kind] = torch.compile(body, fullgraph=True, dynamic=None, options=self._options)
        return fn

    def _prepare(self, ids: torch.Tensor, n_pos: int, pool: Any) -> None:
        lean = self.lean
        # Growth stays out of the graphs: they read the RoPE table and the pool's buffers, never allocate them.
        lean.rope_table(n_pos, lean.embed.dtype, ids.device)
        if pool is not None:
            rounded = getattr(pool, "round_shapes", False)
            for i in range(len(lean.layers)):
                for t in pool.buffers(i, lean.embed):
                    if rounded and not hasattr(t, "_dynamo_static_indices"):
                        self._mark_static(t)

    def decided(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        pool: Any,
        call: Any,
        n_pos: int,
        rid: torch.Tensor,
        steps: torch.Tensor,
        decision: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step (ids, pos (B, 1)) over ``pool`` (where ``call`` says) with the next step's decision in the
        same graph: logits (B, V), hidden (B, H), tokens (B,) and hard flags (B,); ``rid``/``steps`` (B,) key each
        row's draws. None, having run nothing, when the router cannot be traced; the caller then decides eagerly, and
        so does every later call with that router."""
        if decision.router in self._untraceable:
            return None
        self._prepare(ids, n_pos, pool)
        fn = self._decide_fns.get(mask is None)
        if fn is None:
            tag = f"{id(self.lean):x}_{'0' if mask is None else '1'}"
            body = own_code(_decide_body, tag)
            fn = self._decide_fns[mask is None] = torch.compile(
                body, fullgraph=True, dynamic=None, options=self._options
            )
        try:
            return fn(self.lean, ids, pos, mask, pool, call, n_pos, self._attention, rid, steps, decision)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised tracing or compiling: nothing has run
            self._untraceable.add(decision.router)
            warnings.warn(
                f"the step's decision cannot run inside its graph ({err}); deciding eagerly", stacklevel=3
            )
            return None

    def __call__(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        pool: Any,
        call: Any,
        n_pos: int,
    ) -> torch.Tensor:
        lean = self.lean
        self._prepare(ids, n_pos, pool)
        kind = (
            pool is None,
            mask is None,
            ids.shape[1] == 1,
            call is not None and call.varlen is not None,
            call is None or call.slots is None,
        )
        try:
            return self._fn(kind)(lean, ids, pos, mask, pool, call, n_pos, self._attention)
        except torch._dynamo.exc.TorchDynamoException as err:
            # Raised tracing or compiling, before the graph ran; a rerun writes the same K/V to the same columns.
            self.failed = True
            warnings.warn(
                f"the lean forward cannot be compiled here ({err}); running it eagerly", stacklevel=3
            )
            return lean.hidden(ids, pos, mask, pool, call, n_pos)


def _decide_body(
    lean: Any,
    ids: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor | None,
    pool: Any,
    call: Any,
    n_pos: int,
    attention: str,
    rid: torch.Tensor,
    steps: torch.Tensor,
    d: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The traced body of :meth:`CompiledHidden.decided`: forward, head, decision."""
    hidden = lean.hidden(ids, pos, mask, pool, call, n_pos, attention)[:, 0]  # (B, H)
    logits = lean.logits(hidden)  # (B, V)
    tokens, hard = decide(logits, hidden, rid, steps, d)
    return logits, hidden, tokens, hard


_COMPILED: weakref.WeakKeyDictionary[Any, CompiledHidden] = weakref.WeakKeyDictionary()


def compiled_hidden(lean: Any) -> CompiledHidden:
    """The compiled forward of ``lean`` (one per lean decoder; nothing compiles until its first call)."""
    got = _COMPILED.get(lean)
    if got is None:
        got = _COMPILED[lean] = CompiledHidden(lean)
    return got
