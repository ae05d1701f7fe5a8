"""Fixed-shape steps over a slot pool, captured per bucket: the session's decode steps and LLM catch-ups.

Decode steps and LLM catch-ups of up to :data:`~citer.decoding.runner.STATIC_Q` tokens run here when the engine asks
for fixed-shape steps (``forward="graphs"`` and its siblings in :data:`~citer.decoding.runner.FORWARDS`). Rows and
tokens are bucketed to powers of two; with ``StepMode.graphs`` each bucket's call (forward and decision) is captured
as a CUDA graph over fixed input buffers (one memory pool per model's steps, so two models' graphs can replay at once
on two streams); a replay stages the step's indices from page-locked memory, replays, and copies out what the session
keeps. Off CUDA the same buffers and buckets are replayed by calling the step, so a CPU test runs this path whole.
The pools are the engine's (:meth:`~citer.decoding.engine.RoutedEngine.reserve`), kept across sessions; when one
moves (it grew) its captures are made again. Pad rows and pad tokens repeat a real position and write to the trash
column, so they change no real row's logits. A router the graph cannot hold (one that reads the host) is found by
tracing its decision once before any capture; it then decides eagerly after the step, with a warning.

Compiling (:class:`CompiledPieces`): a call is ``B`` rows of ``Q`` tokens over the whole slot pool (``R`` slots,
``K = capacity + 1`` columns, the last the trash column). ``B``, ``Q`` and ``R`` are symbols of the compiled graph (sizes
treated obliviously, so 1 is not special); only ``K`` is static, so a model compiles once per call kind, whatever the
batch, and captures per bucket (as vLLM does). Each model compiles code objects of its own
(:func:`~citer.decoding.compiled.own_code`): the SLM and the LLM share neither graphs nor the recompile limit, and a
router or τ is never a constant of a forward graph (the decision, :func:`~citer.decoding.decide.decide`, is traced
apart). A model compiles one decoder layer and the head, called layer by layer (regional compilation: a compile costs
one layer's trace whatever the depth; a captured step replays without the Python loop). Everything a step reads from
outside is marked a static address once (:func:`mark_static`), so a CUDA graph never copies it at replay. A failed
compile, or more than :data:`RECOMPILE_LIMIT` graphs of one piece, falls back to eager steps with one warning.
Shapes: B = rows (bucket), Q = tokens per row (bucket), R = pool slots, K = capacity + 1, H = hidden, V = vocab,
kv/D = heads/head_dim.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from citer.decoding.compiled import own_code
from citer.decoding.decide import Decision, decide
from citer.decoding.kv_pool import KVPool, PoolCall
from citer.decoding.lean import LeanDecoder, decoder_layer
from citer.kernels.cpu_linear import linear

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
    calls that compiled, tracing included, and of the backend alone), traces of decisions, captures (and their
    seconds), re-captures after a pool moved, and eager fallbacks."""

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

                # The C++ wrapper calls the kernels without a Python frame each (docs/results.md).
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


# -- one engine's steps: buckets, buffers, captures ---------------------------------------------------------------
def bucket(n: int) -> int:
    """The smallest power of two >= n: the shapes a graph is captured for."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Capture:
    """One bucket's call on fixed buffers: its inputs (the slice of the input buffer it reads), the call, and (CUDA)
    the captured graph whose replay rewrites ``out``."""

    inputs: torch.Tensor
    run: Callable[[], tuple[torch.Tensor, ...]]
    graph: Any = None
    out: tuple[torch.Tensor, ...] = ()

    def replay(self) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.out


class StaticSteps:
    """Bucketed fixed-shape calls of one model over a :class:`~citer.decoding.kv_pool.KVPool`'s
    pool, in one :class:`StepMode`; one object per engine and model, its compiled pieces the model's."""

    def __init__(self, lean: LeanDecoder, mode: StepMode) -> None:
        self.lean, self.mode = lean, mode
        self.stats = step_stats(lean)
        self.compiled = compiled_pieces(lean, mode) if mode.backend is not None else None
        dev = lean.embed.device
        self.device = dev
        self.cuda = dev.type == "cuda"
        # RoPE tables for the model's whole context now, so no later call (this one's or the ragged path's) moves them.
        lean.rope_table(lean.max_positions, lean.embed.dtype, dev)
        for t in lean.static_tensors():
            mark_static(t)
        self._untraceable: weakref.WeakSet[Any] = weakref.WeakSet()  # routers whose decision cannot be traced
        self._decide_fns: dict[Decision, Callable[..., Any]] = {}
        # graphs: the fixed input buffer, the captures by (B, Q, kind, decision), and what they were captured against
        self._in: torch.Tensor | None = None
        self._pinned: torch.Tensor | None = None
        self._staged: Any = None  # the event after the last staging copy (CUDA)
        self._captures: dict[tuple[Any, ...], _Capture] = {}
        self._against: tuple[torch.Tensor, ...] = ()
        self._mempool = torch.cuda.graph_pool_handle() if mode.graphs and self.cuda else None

    # -- kinds -------------------------------------------------------------------------------------------------------
    def _kind(self, step: bool, every: bool) -> StepKind:
        """A decode step over the slot prefix, or a catch-up over named slots. Regional pieces serve both with one
        layer graph (the step's rows gathered like a catch-up's, Q a symbol), so a model compiles one layer and one
        head for every bucket; eager steps read the prefix as a slice. Compiled, the attention is fused products and
        sums (``lean.decoder_layer``'s "fused"); eager, two batched matrix products."""
        fused = self.compiled is not None
        if step and not fused:
            return StepKind(prefix=True, q1=True, every=False, fused=fused)
        return StepKind(prefix=False, q1=False, every=every, fused=fused)

    # -- the session's calls -----------------------------------------------------------------------------------------
    def __call__(
        self, pool: KVPool, chunks: Sequence[Sequence[int]], slots: Sequence[int], every: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``chunks[i]`` to slot ``slots[i]``; logits (b, V) and hidden (b, H) at each row's last fed token
        (an empty chunk holds its row, as in :meth:`~citer.decoding.runner.ModelRunner.feed`); ``every``: (b, Q, .)
        at every position, Q = the longest chunk."""
        b = len(chunks)
        q = max(len(c) for c in chunks)
        kind = self._kind(step=False, every=every)
        logits, hidden = self._call(pool, chunks, list(slots), kind, None, (), ())
        for s, c in zip(slots, chunks, strict=True):
            pool.lengths[s] += len(c)
        if every:
            return self._keep(logits[:b, :q]), self._keep(hidden[:b, :q])
        return self._keep(logits[:b]), self._keep(hidden[:b])

    def decided(
        self,
        pool: KVPool,
        chunks: Sequence[Sequence[int]],
        rid: Sequence[int],
        steps: Sequence[int],
        decision: Decision,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step over the slot prefix (``chunks[i]``: slot i's one token, or empty to hold it) with the next
        step's decision right after it: logits (b, V), hidden (b, H), tokens (b,) and hard flags (b,);
        ``rid``/``steps`` (b,) key each row's draws. A router whose decision cannot be traced decides eagerly after
        the step (warned once)."""
        b = len(chunks)
        out = self._call(
            pool, chunks, list(range(b)), self._kind(step=True, every=False), decision, rid, steps
        )
        for s, c in zip(range(b), chunks, strict=True):
            pool.lengths[s] += len(c)
        logits, hidden = self._keep(out[0][:b]), self._keep(out[1][:b])
        if len(out) == 2:  # the router's decision cannot be traced: decided eagerly, after the step
            dev = logits.device
            r, st = (torch.tensor(list(x), dtype=torch.long, device=dev) for x in (rid, steps))
            return logits, hidden, *decide(logits, hidden, r, st, decision)
        return logits, hidden, self._keep(out[2][:b]), self._keep(out[3][:b])

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        """A copy of a captured graph's output (its next replay overwrites it); other outputs as they are."""
        return x.clone() if self.mode.graphs and self.cuda else x

    # -- inputs ------------------------------------------------------------------------------------------------------
    def _shape(self, b: int, q: int) -> tuple[int, int]:
        return bucket(b), bucket(q)

    def _host_inputs(
        self,
        pool: KVPool,
        chunks: Sequence[Sequence[int]],
        slots: list[int],
        big_b: int,
        big_q: int,
        kind: StepKind,
        rid: Sequence[int],
        steps: Sequence[int],
    ) -> list[int]:
        """The call's indices as one flat list: ids, pos, cols, tok_slot (B*Q each), then slots, last, rid, steps (B
        each). A held or pad row re-queries its last position and writes only to the trash column; a prefix call's pad
        rows are the next slots (the pool's rows are a power of two, so they exist), a gathered call's repeat slot 0."""
        b = len(chunks)
        trash = pool.capacity
        ids: list[int] = []
        pos: list[int] = []
        cols: list[int] = []
        tok: list[int] = []
        slot_row = slots + ([*range(b, big_b)] if kind.prefix else [slots[0]] * (big_b - b))
        for i in range(big_b):
            c = chunks[i] if i < b else []
            n = pool.lengths[slots[i]] if i < b else 1
            tok += [slot_row[i]] * big_q
            if not c:
                ids += [0] * big_q
                pos += [max(n - 1, 0)] * big_q
                cols += [trash] * big_q
                continue
            g = len(c)
            ids += [*c, *[c[-1]] * (big_q - g)]
            pos += [n + min(j, g - 1) for j in range(big_q)]
            cols += [n + j if j < g else trash for j in range(big_q)]
        last = [max(len(chunks[i]), 1) - 1 if i < b else 0 for i in range(big_b)]
        pad = [0] * (big_b - len(rid)) if rid else [0] * big_b
        return ids + pos + cols + tok + slot_row + last + [*rid, *pad] + [*steps, *pad]

    @staticmethod
    def _views(flat: torch.Tensor, big_b: int, big_q: int) -> list[torch.Tensor]:
        """ids, pos, cols, tok_slot (B, Q) and slots, last, rid, steps (B,) as views of a flat buffer."""
        n = big_b * big_q
        out = [flat[i * n : (i + 1) * n].view(big_b, big_q) for i in range(4)]
        base = 4 * n
        return out + [flat[base + i * big_b : base + (i + 1) * big_b] for i in range(4)]

    def _pool(self, pool: KVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        like = self.lean.embed
        bufs = [pool.buffers(i, like) for i in range(len(self.lean.layers))]
        keys, values = [k for k, _ in bufs], [v for _, v in bufs]
        for t in (*keys, *values):
            mark_static(t)
        return keys, values

    # -- running -----------------------------------------------------------------------------------------------------
    def _call(
        self,
        pool: KVPool,
        chunks: Sequence[Sequence[int]],
        slots: list[int],
        kind: StepKind,
        decision: Decision | None,
        rid: Sequence[int],
        steps: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:
        b, q = len(chunks), max(len(c) for c in chunks)
        big_b, big_q = self._shape(b, 1 if kind.q1 else q)
        self.stats.buckets.add((big_b, big_q))
        keys, values = self._pool(pool)
        flat = self._host_inputs(pool, chunks, slots, big_b, big_q, kind, rid, steps)
        if not self.mode.graphs:
            t = torch.tensor(flat, dtype=torch.long, device=self.device)
            return self._run(keys, values, self._views(t, big_b, big_q), kind, decision)
        cap = self._capture_for(pool, keys, values, big_b, big_q, kind, decision)
        self._stage(cap.inputs, flat)
        return cap.replay()

    def _run(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        views: list[torch.Tensor],
        kind: StepKind,
        decision: Decision | None,
    ) -> tuple[torch.Tensor, ...]:
        """The forward (compiled or eager) and, for a decided step, the decision after it."""
        ids, pos, cols, tok_slot, slots, last, rid, steps = views
        args = (self.lean, keys, values, ids, pos, cols, tok_slot, slots, last, kind)
        logits, hidden = step_body(*args) if self.compiled is None else self.compiled.forward(args, kind)
        if decision is None or decision.router in self._untraceable:
            return logits, hidden
        try:
            tokens, hard = self._decide(decision)(logits, hidden, rid, steps, decision)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised tracing, before the decision ran
            self._untraceable.add(decision.router)
            warnings.warn(
                f"the router cannot run inside the step's graph ({err}); deciding eagerly", stacklevel=5
            )
            return logits, hidden
        return logits, hidden, tokens, hard

    # -- decisions ---------------------------------------------------------------------------------------------------
    def _decide(self, d: Decision) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The decision as it runs inside a step. Traced whole once (``fullgraph``, rows a symbol) where the step is
        captured or traced by a checking backend, so that a router which reads the host is found before any capture:
        Inductor modes only trace it (backend ``eager``), others use their backend. Elsewhere it runs eagerly."""
        fn = self._decide_fns.get(d)
        if fn is not None:
            return fn
        if self.mode.backend is None:
            fn = decide
        else:
            backend = "eager" if self.mode.backend == "inductor" else self.mode.backend
            own = own_code(decide, f"{id(self):x}_{len(self._decide_fns)}")
            traced = torch.compile(own, fullgraph=True, dynamic=None, backend=backend)

            def fn(*a: Any, traced: Any = traced) -> tuple[torch.Tensor, torch.Tensor]:
                for t in a[:4]:
                    mark_dims(t, 0)
                with compile_context():
                    out = traced(*a)
                self.stats.decision_traces = len(self._decide_fns)
                return out

        self._decide_fns[d] = fn
        return fn

    # -- captures ----------------------------------------------------------------------------------------------------
    def _capture_for(
        self,
        pool: KVPool,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        big_b: int,
        big_q: int,
        kind: StepKind,
        decision: Decision | None,
    ) -> _Capture:
        against = (*keys, *values)
        if len(against) != len(self._against) or any(
            a is not b for a, b in zip(against, self._against, strict=True)
        ):
            if self._captures:
                self.stats.recaptures += 1
            self._captures.clear()  # the pool moved: captures read the old addresses
            self._against = against
        key = (big_b, big_q, kind, decision)
        cap = self._captures.get(key)
        if cap is not None:
            return cap
        need = 4 * big_b * big_q + 4 * big_b
        if self._in is None or self._in.numel() < need:
            self._captures.clear()  # a larger input buffer: every capture reads the old one
            self._in = torch.zeros(max(need, 1024), dtype=torch.long, device=self.device)
            mark_static(self._in)
            if self.cuda:
                self._pinned = torch.zeros(self._in.numel(), dtype=torch.long).pin_memory()
        flat = self._in[:need]
        views = self._views(flat, big_b, big_q)
        for v in views:
            mark_static(v)
        # Harmless inputs for the warm-up (the buffer holds another bucket's indices, laid out otherwise): every token
        # of slot 0 at position 0, writing to the trash column.
        flat.zero_()
        views[2].fill_(pool.capacity)

        def run() -> tuple[torch.Tensor, ...]:
            return self._run(keys, values, views, kind, decision)

        cap = _Capture(flat, run)
        t = time.perf_counter()
        if self.cuda:
            self._cuda_capture(cap)
        else:  # the same warm-up off CUDA, so a CPU test runs it
            cap.run()
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t
        self._captures[key] = cap
        return cap

    def _cuda_capture(self, cap: _Capture) -> None:
        """Warm the call up on a side stream (compiles happen here, never inside a capture), then capture it."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            cap.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = cap.run()
        cap.graph, cap.out = graph, out

    def _stage(self, dst: torch.Tensor, flat: list[int]) -> None:
        """Copy the call's indices into the fixed input buffer: on CUDA through page-locked memory, queued on the
        current stream (the host does not wait for the device)."""
        n = len(flat)
        if not self.cuda:
            dst.copy_(torch.tensor(flat, dtype=torch.long))
            return
        assert self._pinned is not None
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the page-locked buffer is done
        self._pinned.numpy()[:n] = flat
        dst.copy_(self._pinned[:n], non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
