"""Fixed-shape decode steps over a ragged cache's slot pool, for graph capture (CUDA graphs) or ``torch.compile``.

:func:`static_append` is the whole forward of one call as tensor ops on fixed shapes: ``B`` rows (a bucket: 1, 2, 4,
8, ...), ``Q`` tokens per row (a bucket too: 1 for an SLM step, more for an LLM catch-up) and every column of the
pool (``K = capacity + 1``, the last one the trash column padded queries write to). Nothing in it reads a value back
to the host or makes a shape from data, so ``torch.compile(fullgraph=True)`` traces it without a break and a bucket
never recompiles; on CUDA, ``mode="reduce-overhead"`` replays it as a CUDA graph (the pool's buffers are marked static
addresses, so K/V are written in place). Admission, retirement and growth of the pool stay eager; growing the pool
or its columns changes ``K`` or the buffers and so is a rare, explicit re-capture.

:class:`StaticSteps` turns a ragged call (chunks per slot) into padded bucket inputs and back. Pad rows and pad tokens
repeat a real position and write to the trash column, so they change no real row's logits.
Shapes: B = rows bucket, Q = tokens bucket, K = capacity + 1, H = hidden, V = vocab, kv/D = heads/head_dim.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo

from citer.decoding.choice import Sampling, step_decisions
from citer.decoding.lean import LeanDecoder


def bucket(n: int) -> int:
    """The smallest power of two >= n: the shapes a graph is captured for."""
    return 1 << max(n - 1, 0).bit_length()


class _PoolWriter:
    """The ``update`` the lean forward calls per layer: write this call's K/V at (slot, column), return the slots'
    whole rows of the pool (B, kv, K, D)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, cols: torch.Tensor
    ):
        self.keys, self.values, self.slots, self.cols = keys, values, slots, cols

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self.keys[layer], self.values[layer]
        rows = self.slots[:, None]  # (B, 1)
        kb[rows, :, self.cols] = k.transpose(1, 2)  # (B, Q, kv, D) into (slot, :, col)
        vb[rows, :, self.cols] = v.transpose(1, 2)
        return kb.index_select(0, self.slots), vb.index_select(0, self.slots)


def static_append(
    lean: LeanDecoder,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids: torch.Tensor,
    pos: torch.Tensor,
    cols: torch.Tensor,
    slots: torch.Tensor,
    last: torch.Tensor,
    every: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed-shape call. ids, pos, cols (B, Q) long; slots (B,) pool rows; last (B,) the index of each row's last
    real token. keys/values: per layer the pool (R, kv, K, D). Returns logits (B, V) and hidden (B, H) there
    (``every``: (B, Q, V) and (B, Q, H) at every position, a graph of its own)."""
    k_cols = keys[0].shape[2]
    mask = torch.arange(k_cols, device=pos.device) <= pos[:, None, :, None]  # (B, 1, Q, K)
    hidden = lean.hidden(ids, pos, mask, _PoolWriter(keys, values, slots, cols), k_cols)  # (B, Q, H)
    if every:
        return lean.logits(hidden), hidden
    hidden = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]  # (B, H)
    return lean.logits(hidden), hidden


def static_decide(
    decision: Decision, rid: torch.Tensor, steps: torch.Tensor, *call: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An SLM decode step with its decision in the same graph: :func:`static_append` over ``call`` (its arguments),
    then the router's score, the token choice and the hard flag (:func:`~citer.decoding.choice.step_decisions`)
    for every row. rid/steps (B,) key each row's draws at the step that reads this decision. Returns logits (B, V),
    hidden (B, H), tokens (B,) long and hard (B,) bool."""
    logits, hidden = static_append(*call)
    d = decision
    tokens, hard = step_decisions(
        logits, hidden, rid, steps, d.router, d.takes_rows, d.tau, d.vocab_size, d.sampling
    )
    return logits, hidden, tokens, hard


@dataclass(frozen=True)
class Decision:
    """What a step's decision reads besides the model: the router (``takes_rows``: it keys draws on row ids), τ,
    the shared vocabulary and the rows' one sampling setting (temperature, top_p, seed). A traced step guards on
    these, so one object per (engine, sampling) keeps one graph per bucket."""

    router: Callable[..., torch.Tensor]
    takes_rows: bool
    tau: float
    vocab_size: int
    sampling: Sampling


class StaticSteps:
    """Bucketed fixed-shape calls of one model over one :class:`~citer.decoding.kv_cache.RaggedKVCache`.

    ``compile``: None runs :func:`static_append` eagerly; otherwise ``torch.compile`` options (e.g.
    ``{"mode": "reduce-overhead"}`` on CUDA for CUDA graphs, ``{"backend": "aot_eager"}`` to check capturability
    on a CPU), always ``fullgraph=True`` and ``dynamic=False``: one graph per (B, Q, pool) bucket.
    """

    def __init__(self, lean: LeanDecoder, compile: dict[str, Any] | None = None) -> None:
        self.lean = lean
        self.fn: Callable[..., Any] = static_append
        self.decide_fn: Callable[..., Any] = static_decide
        if compile is not None:
            # One graph per bucket: raise dynamo's per-function limit above the buckets a session can use.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(static_append, fullgraph=True, dynamic=False, **compile)
            self.decide_fn = torch.compile(static_decide, fullgraph=True, dynamic=False, **compile)
        self._marked: set[int] = set()
        self._untraceable: weakref.WeakSet[Any] = weakref.WeakSet()  # routers whose trace failed
        # CUDA graphs (reduce-overhead) hand back outputs in the graph's own memory, which its next replay overwrites;
        # the session keeps a step's logits and decisions past that, so they are copied out (b x V, small).
        self._copy_out = bool(compile and compile.get("mode") == "reduce-overhead" and lean.embed.is_cuda)

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone() if self._copy_out else x

    def __call__(
        self, cache: Any, chunks: Sequence[Sequence[int]], slots: Sequence[int], every: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``chunks[i]`` to slot ``slots[i]``; logits (b, V) and hidden (b, H) at each row's last fed token
        (an empty chunk holds its row, as in :func:`~citer.decoding.kv_cache.ragged_append`); ``every``: (b, Q, .)
        at every position, Q = the longest chunk."""
        b = len(chunks)
        keys, values, t, extra = self._inputs(cache, chunks, slots)
        logits, hidden = self.fn(self.lean, keys, values, *t, *extra, every)
        for s, c in zip(slots, chunks, strict=True):
            cache.lengths[s] += len(c)
        if every:
            g = max(len(c) for c in chunks)
            return self._out(logits[:b, :g]), self._out(hidden[:b, :g])
        return self._out(logits[:b]), self._out(hidden[:b])

    def decided(
        self,
        cache: Any,
        chunks: Sequence[Sequence[int]],
        rid: Sequence[int],
        steps: Sequence[int],
        decision: Decision,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step over the slot prefix (``chunks[i]``: slot i's one token, or empty to hold it) with the next
        step's decision in the same graph: logits (b, V), hidden (b, H), tokens (b,) and hard flags (b,);
        ``rid``/``steps`` (b,) key each row's draws. None, having run nothing, when the router cannot be traced
        (a host read, an unsupported op): the caller then decides eagerly, and so does every later call."""
        if decision.router in self._untraceable:
            return None
        b = len(chunks)
        slots = range(b)
        keys, values, t, extra = self._inputs(cache, chunks, slots)
        big_b = t.shape[1]
        draw = torch.tensor(
            [[*rid, *[0] * (big_b - b)], [*steps, *[0] * (big_b - b)]], dtype=torch.long, device=cache.device
        )  # (2, B)
        try:
            out = self.decide_fn(decision, draw[0], draw[1], self.lean, keys, values, *t, *extra)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised tracing or compiling: nothing has run
            self._untraceable.add(decision.router)
            warnings.warn(
                f"the router cannot run inside the step's graph ({err}); deciding eagerly", stacklevel=2
            )
            return None
        for s, c in zip(slots, chunks, strict=True):
            cache.lengths[s] += len(c)
        return tuple(self._out(x[:b]) for x in out)  # type: ignore[return-value]

    def _inputs(
        self, cache: Any, chunks: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The pool's per-layer keys and values, ids/pos/cols (3, B, Q) and slots/last (2, B) of one bucketed call."""
        b = len(chunks)
        big_b, q = bucket(b), bucket(max(len(c) for c in chunks))
        keys, values = self._pool(cache)
        ids, pos, cols = [], [], []
        # Pad rows write only to the trash column, which no query attends, so any slot serves; slot 0 always exists.
        slot_row = list(slots) + [slots[0]] * (big_b - b)
        for i in range(big_b):
            c = chunks[i] if i < b else []
            n = cache.lengths[slots[i]] if i < b else 1
            if not c:  # held or pad row: re-query the last position, write to the trash column
                ids.append([0] * q)
                pos.append([max(n - 1, 0)] * q)
                cols.append([cache.capacity] * q)
                continue
            g = len(c)
            ids.append(list(c) + [c[-1]] * (q - g))
            pos.append([n + min(j, g - 1) for j in range(q)])
            cols.append([n + j if j < g else cache.capacity for j in range(q)])
        last = [max(len(chunks[i]), 1) - 1 if i < b else 0 for i in range(big_b)]
        dev = cache.device
        t = torch.tensor([ids, pos, cols], dtype=torch.long, device=dev)  # (3, B, Q)
        extra = torch.tensor([slot_row, last], dtype=torch.long, device=dev)  # (2, B)
        return keys, values, t, extra

    def _pool(self, cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        like = self.lean.embed
        bufs = [cache._buffers(i, like) for i in range(len(self.lean.layers))]
        keys, values = [k for k, _ in bufs], [v for _, v in bufs]
        if like.is_cuda:  # CUDA graphs write K/V in place only into buffers at fixed addresses
            for t in (*keys, *values):
                if id(t) not in self._marked:
                    torch._dynamo.mark_static_address(t)
                    self._marked.add(id(t))
        return keys, values
