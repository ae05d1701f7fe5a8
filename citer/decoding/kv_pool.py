"""One model's KV pool: :class:`KVPool`, a slot per row, rows of different lengths side by side.

A forward call writes its new keys and reads the keys it attends through :func:`write_and_read` on a layer's
buffers, told where by the call's :class:`PoolCall` (built by :func:`~citer.decoding.context.prepare`, or by a
fixed-shape step); the pool keeps no per-call state. The
HF forward (families the lean one does not cover) reads it through :class:`HFPoolView`, an HF ``Cache`` for the
length of one call.
Shapes: b = rows in a call, Q = longest chunk, N = tokens of a packed call, K = key columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from citer.decoding.pairing import input_device


@dataclass
class PoolCall:
    """Where one call's keys go in the pool and which the call attends (what :func:`write_and_read` reads).

    The new keys go to (``rows``, ``cols``): (b, Q) index tensors (``rows`` may be (b, 1), broadcast), (1, N) for a
    packed call. The call attends the slot prefix 0..b-1 as views (``slots`` None), the named ``slots`` (gathered,
    or in place a run at a time with ``runs``), or (``keys``) the packed rows' own columns as one sequence."""

    kv_len: int  # K: columns attended (the longest row after the call; a fixed-shape step: every column)
    rows: torch.Tensor | None = None  # (b, 1) or (b, Q) the slot each new key goes to; packed (1, N)
    cols: torch.Tensor | None = None  # (b, Q) the column each new key goes to; packed (1, N)
    slots: torch.Tensor | None = None  # (b,) the rows' slots; None = the prefix 0..b-1, read as views
    # The HF forward's packed call: (key_slot, key_col) (sum K_i,) of the keys every token's row attends (one sequence
    # under a block-diagonal mask).
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    # A packed call of the lean forward attends per row: (tok_row (N,), tok_j (N,), b, Q).
    varlen: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
    # Named slots attended in place (the eager lean forward): (first row in the call, first slot, rows) per run of
    # consecutive slots; the whole buffers are returned and the forward attends each run's view.
    runs: tuple[tuple[int, int, int], ...] | None = None


def write_and_read(
    kbuf: torch.Tensor, vbuf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PoolCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new keys/values k, v (b, kv_heads, Q, head_dim) (packed: (1, kv_heads, N, head_dim)) into
    its buffers (R, kv_heads, capacity + 1, head_dim) where ``call`` says, and return what its queries attend: the
    prefix's or the named slots' (b, kv_heads, K, head_dim) (a view, or a gather), with ``runs`` the whole buffers,
    with ``keys`` (1, kv_heads, sum K_i, head_dim). The write goes through a (R, K, kv_heads, head_dim) view with
    index tensors of the call's shape, which no size of b or Q turns into a broadcast (a guard, in a traced step)."""
    dev = kbuf.device  # the layer's device; index tensors were built on the input device
    assert call.rows is not None and call.cols is not None
    rows = call.rows if call.rows.device == dev else call.rows.to(dev)
    cols = call.cols if call.cols.device == dev else call.cols.to(dev)
    # Indexed dims first: the values land as (b, Q, kv_heads, D).
    kbuf.transpose(1, 2).index_put_((rows, cols), k.transpose(1, 2))
    vbuf.transpose(1, 2).index_put_((rows, cols), v.transpose(1, 2))
    if call.keys is not None:
        key_slot, key_col = (t.to(dev) for t in call.keys)
        keys, values = kbuf[key_slot, :, key_col], vbuf[key_slot, :, key_col]  # (sum K_i, kv_heads, D)
        return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if call.runs is not None:
        return kbuf, vbuf  # the caller attends each run's rows in place
    if call.slots is None:
        b = k.shape[0]
        return kbuf[:b, :, : call.kv_len], vbuf[:b, :, : call.kv_len]
    slots = call.slots if call.slots.device == dev else call.slots.to(dev)
    # A gather: the named rows' keys, cut to the longest (b, kv_heads, K, head_dim).
    return kbuf[:, :, : call.kv_len].index_select(0, slots), vbuf[:, :, : call.kv_len].index_select(0, slots)


def compaction(n_live: int, slots: Sequence[int]) -> tuple[int, dict[int, int]]:
    """Which rows move when ``slots`` of the ``n_live`` live slots 0..n_live-1 are freed, so the live ones stay a
    prefix: each row past the new end fills a hole (one move per hole, not a compaction of every row). Returns the
    new live count and ``{old_slot: new_slot}`` (every pool's ``remove_slots``)."""
    gone = set(slots)
    keep_n = n_live - len(gone)
    holes = sorted(s for s in gone if s < keep_n)
    movers = [s for s in range(keep_n, n_live) if s not in gone]
    return keep_n, dict(zip(movers, holes, strict=True))


class KVPool:
    """Per layer a (R, kv_heads, capacity + 1, head_dim) buffer; slot r holds ``lengths[r]`` columns, and the last
    column is the trash column a padded call's pad keys go to (padded and packed calls: :mod:`citer.decoding.context`).
    ``add_slots`` and ``remove_slots`` keep the active rows a prefix, so the common call reads views, not gathers."""

    def __init__(self, model: nn.Module, n_rows: int, capacity: int, round_shapes: bool = False) -> None:
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._row_shape = (kv_heads, capacity + 1, head_dim)
        # Allocated by a layer's first update, on the device and in the dtype its keys arrive in: a model split by a
        # device_map keeps each layer's cache beside the layer.
        self.keys: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
        self.device = input_device(model)  # where ids, positions, masks and index tensors are built
        self.capacity = capacity
        self.lengths = [0] * n_rows  # valid columns per active slot; the active slots are 0..len-1
        self._alloc = n_rows  # slots the buffers hold (>= active)
        # Rows rounded up to a power of two and columns to a multiple of 128, so that a compiled forward sees a few
        # pool shapes and compiles its graphs for them (citer.decoding.compiled); from the next allocation on.
        self.round_shapes = round_shapes

    def reset(self) -> None:
        """Forget every row, keeping the buffers (and their addresses) for the next session."""
        self.lengths = []

    def reserve(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """Allocate (now, in ``like``'s dtype and device) room for ``rows`` slots of ``columns`` tokens."""
        self.ensure_capacity(columns)
        if rows > self._alloc:
            alloc = 1 << (rows - 1).bit_length() if self.round_shapes else rows
            self.keys = [self._grown(t, rows=alloc) for t in self.keys]
            self.values = [self._grown(t, rows=alloc) for t in self.values]
            self._alloc = alloc
        for i in range(len(self.keys)):
            self.buffers(i, like)

    def add_slots(self, k: int) -> list[int]:
        """Open ``k`` empty slots after the active ones; the pool doubles when it runs out (amortised copies)."""
        n = len(self.lengths)
        if n + k > self._alloc:
            alloc = max(n + k, 2 * self._alloc)
            if self.round_shapes:
                alloc = 1 << (alloc - 1).bit_length()
            self.keys = [self._grown(t, rows=alloc) for t in self.keys]
            self.values = [self._grown(t, rows=alloc) for t in self.values]
            self._alloc = alloc
        self.lengths += [0] * k
        return list(range(n, n + k))

    def remove_slots(self, slots: Sequence[int]) -> dict[int, int]:
        """Free ``slots``; the active slots stay a prefix by moving tail rows into the holes (one row copy per hole,
        not a compaction of every row). Returns ``{old_slot: new_slot}`` for the rows that moved."""
        keep_n, moved = compaction(len(self.lengths), slots)
        if moved:
            src = torch.tensor(list(moved), dtype=torch.long)
            dst = torch.tensor(list(moved.values()), dtype=torch.long)
            for t in (*self.keys, *self.values):
                if t is not None:
                    t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))
            for a, b in moved.items():
                self.lengths[b] = self.lengths[a]
        del self.lengths[keep_n:]
        return moved

    def room(self, columns: Sequence[int]) -> int:
        """How many of the next rows, asking ``columns[i]`` tokens each, may be admitted now: all (the pool grows)."""
        return len(columns)

    def rewind(self, slot: int, length: int) -> None:
        """Slot ``slot`` keeps its first ``length`` columns (a verified row cut; later calls overwrite the rest)."""
        self.lengths[slot] = length

    def ensure_capacity(self, columns: int) -> None:
        """Grow every slot to hold ``columns`` tokens (the trash column moves to the new end)."""
        if columns <= self.capacity:
            return
        cap = max(columns, self.capacity + self.capacity // 2)
        if self.round_shapes:
            cap = -(-cap // 128) * 128
        self.keys = [self._grown(t, cols=cap) for t in self.keys]
        self.values = [self._grown(t, cols=cap) for t in self.values]
        self.capacity = cap
        self._row_shape = (self._row_shape[0], cap + 1, self._row_shape[2])

    def _grown(
        self, t: torch.Tensor | None, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor | None:
        if t is None:
            return None
        r = t.shape[0] if rows is None else rows
        c = t.shape[2] if cols is None else cols + 1
        out = torch.zeros((r, t.shape[1], c, t.shape[3]), dtype=t.dtype, device=t.device)
        keep_c = min(t.shape[2] - 1, c - 1)  # the old trash column is not carried over
        out[: t.shape[0], :, :keep_c] = t[:, :, :keep_c]
        return out

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is None:
            shape = (self._alloc, *self._row_shape)
            self.keys[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[layer_idx], self.values[layer_idx]  # type: ignore[return-value]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, call: PoolCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's :func:`write_and_read` on this pool's buffers (HF's decoder layers call it)."""
        kbuf, vbuf = self.buffers(layer_idx, key_states)
        return write_and_read(kbuf, vbuf, key_states, value_states, call)


class HFPoolView(Cache):
    """A pool as HF's decoder layers read it during one call (the HF forward, for families the lean one does not
    cover): their ``update`` is the pool's, with the call's :class:`PoolCall`."""

    def __init__(self, pool: KVPool, call: PoolCall) -> None:
        super().__init__(layers=[])
        self.pool, self.call = pool, call

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.update(key_states, value_states, layer_idx, self.call)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.pool.lengths, default=0)
