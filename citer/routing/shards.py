"""Label collection cut into shards: which examples / branches each shard holds, one shard's passes, the merge.

Teacher-forced passes batch examples sorted by length and rollouts batch branches sorted by prefix length, in the
orders :func:`citer.routing.labels.teacher_forced_order` and :func:`citer.routing.rollouts.rollout_order` define for
those passes. A shard here is a contiguous run of whole batches of exactly that order (:mod:`citer.routing.sharding`); both
passes sort stably, so run on a shard's items (already in that order) they rebuild the very same batches, and the
merged result equals the single-process one bit for bit. ``tests/routing/test_sharding.py`` pins this against the batches the
functions really form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from citer.routing.labels import (
    Encoded,
    LabelWork,
    TeacherForced,
    assemble_teacher_forced,
    teacher_forced_order,
)
from citer.routing.rollouts import Branch, rollout_order
from citer.routing.sharding import ShardError, merge_by_index, split_batches

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
