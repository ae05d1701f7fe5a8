"""Label collection cut into shards: which examples / branches each shard holds, one shard's passes, the merge.

A shard is a contiguous run of *whole batches* of the order the single-process run uses: teacher-forced passes batch
examples sorted by length and rollouts batch branches sorted by prefix length, in the orders
:func:`citer.routing.labels.teacher_forced_order` and :func:`citer.routing.rollouts.rollout_order` define. Both passes
sort stably, so run on a shard's items (already in that order) they rebuild the very same batches, with the same
padding, and a model's outputs for them are the same bits (same device, dtype and thread count); merging the shards
by item index then gives exactly the single-process result. ``tests/routing/test_shards.py`` pins this against the
batches the functions really form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from citer.routing.labels import (
    Encoded,
    LabelWork,
    TeacherForced,
    assemble_teacher_forced,
    teacher_forced_order,
)
from citer.routing.rollouts import Branch, rollout_order

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


# What a teacher-forced shard returns: per target token of its examples, in shard order.
TF_KEYS = ("slm_token", "llm_token", "hidden")


def teacher_forced_shards(encoded: Sequence[Encoded], batch_size: int, n_shards: int) -> list[list[int]]:
    """Example indices per shard, each shard whole batches of :func:`teacher_forced_order`."""
    return split_batches(teacher_forced_order(encoded), batch_size, n_shards)


def rollout_shards(
    encoded: Sequence[Encoded], branches: Sequence[Branch], eos: int, batch_size: int, n_shards: int
) -> list[list[int]]:
    """Branch indices per shard: whole batches of :func:`rollout_order`; the EOS branches (graded from the text
    already written, no batch) ride with the first shard."""
    shards = split_batches(rollout_order(encoded, branches, eos), batch_size, n_shards)
    ends = [j for j, br in enumerate(branches) if br.token == eos]
    if not ends:
        return shards
    return [ends + shards[0], *shards[1:]] if shards else [ends]


def run_teacher_forced_shard(
    work: LabelWork,
    encoded: Sequence[Encoded],
    ids: Sequence[int],
    batch_size: int,
    hidden_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One shard's teacher-forced pass: ``TF_KEYS`` per target token of ``ids`` (in that order). Hidden states are
    cast to the label set's dtype here, which halves what travels back and is what the single process does last."""
    tf = work.teacher_forced([encoded[i] for i in ids], batch_size)
    return {"slm_token": tf.slm_token, "llm_token": tf.llm_token, "hidden": tf.hidden.to(hidden_dtype)}


def merge_teacher_forced(
    encoded: Sequence[Encoded], shards: Sequence[Sequence[int]], parts: Sequence[Mapping[str, torch.Tensor]]
) -> TeacherForced:
    """The shards' results as one :class:`TeacherForced`, in example order."""
    per_ex: dict[int, tuple[torch.Tensor, ...]] = {}
    for s, (ids, part) in enumerate(zip(shards, parts, strict=True)):
        lengths = [len(encoded[i].target) for i in ids]
        if any(int(part[k].shape[0]) != sum(lengths) for k in TF_KEYS):
            raise ShardError(f"merge: teacher-forced shard {s} returned the wrong number of tokens")
        pieces = [torch.split(part[k], lengths) for k in TF_KEYS]
        for j, i in enumerate(ids):
            per_ex[i] = tuple(p[j] for p in pieces)
    if sorted(per_ex) != list(range(len(encoded))):
        raise ShardError(f"merge: teacher-forced shards cover {len(per_ex)} of {len(encoded)} examples")
    return assemble_teacher_forced(encoded, per_ex)  # type: ignore[arg-type]  # 3-tuples by TF_KEYS


def merge_rollouts(n: int, shards: Sequence[Sequence[int]], parts: Sequence[Sequence[bool]]) -> list[bool]:
    """Per branch, whether its rollout's answer is right, in branch order."""
    return [bool(x) for x in merge_by_index(n, shards, parts)]


def branches_tensor(branches: Sequence[Branch]) -> torch.Tensor:
    """``(n, 3)`` long: (example, position, token) per branch; what a rollout shard is sent (compact to ship)."""
    return torch.tensor([[b.ex, b.position, b.token] for b in branches], dtype=torch.long).reshape(-1, 3)


def branches_from(t: torch.Tensor) -> list[Branch]:
    return [Branch(int(e), int(p), int(k)) for e, p, k in t.tolist()]
