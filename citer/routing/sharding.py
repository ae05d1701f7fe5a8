"""Cutting batched work into shards and putting the shards' results back, so that sharding changes nothing.

A shard is a contiguous run of *whole batches* of the order the single-process run uses. Every batch therefore holds
the same items, in the same order and with the same padding, wherever it runs, and a model's outputs for it are the
same bits (same device, dtype and thread count); merging the shards by item index then gives exactly the
single-process result. Pure Python: no torch, no Prefect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


class ShardError(ValueError):
    """Shards that do not cover the work exactly once, or a shard result of the wrong length."""


def batches_of(order: Sequence[int], batch_size: int) -> list[list[int]]:
    """``order`` cut into consecutive batches of ``batch_size`` (the last one may be shorter)."""
    if batch_size < 1:
        raise ShardError(f"batch_size: {batch_size} is not allowed (must be >= 1)")
    return [list(order[s : s + batch_size]) for s in range(0, len(order), batch_size)]


def split_batches(order: Sequence[int], batch_size: int, n_shards: int) -> list[list[int]]:
    """Item indices per shard: ``order``'s batches dealt into at most ``n_shards`` contiguous runs whose batch
    counts differ by at most one (earlier shards take the extra batch). No shard is empty."""
    if n_shards < 1:
        raise ShardError(f"n_shards: {n_shards} is not allowed (must be >= 1)")
    batches = batches_of(order, batch_size)
    n = min(n_shards, len(batches))
    if n == 0:
        return []
    base, extra = divmod(len(batches), n)
    shards, start = [], 0
    for s in range(n):
        stop = start + base + (1 if s < extra else 0)
        shards.append([i for b in batches[start:stop] for i in b])
        start = stop
    return shards


def merge_by_index(n: int, shards: Sequence[Sequence[int]], parts: Sequence[Sequence[T]]) -> list[T]:
    """``parts[s][j]`` placed at index ``shards[s][j]``; every index in ``0..n-1`` must be covered exactly once."""
    if len(parts) != len(shards):
        raise ShardError(f"merge: {len(parts)} shard results for {len(shards)} shards")
    out: list[T | None] = [None] * n
    seen = [False] * n
    for s, (idx, part) in enumerate(zip(shards, parts, strict=True)):
        if len(idx) != len(part):
            raise ShardError(f"merge: shard {s} returned {len(part)} results for {len(idx)} items")
        for i, value in zip(idx, part, strict=True):
            if not 0 <= i < n or seen[i]:
                raise ShardError(f"merge: shard {s} holds index {i} outside 0..{n - 1} or twice")
            seen[i] = True
            out[i] = value
    missing = [i for i, hit in enumerate(seen) if not hit]
    if missing:
        raise ShardError(f"merge: indices {missing[:5]} (of {len(missing)}) in no shard")
    return out  # type: ignore[return-value]  # every slot was filled above
