"""A shard worker's side of label collection: the pair, the train examples and the previous router, loaded once per
worker process and kept, and one shard's passes on them. No Prefect here: ``flows/runners.py`` wraps these as tasks.

A worker is sent a small :class:`ShardContext` (the project root, the params, the pair's digests and the examples'
hash), never models or rows: it loads them itself the first time and refuses files that differ from the driver's.
The cache holds one pair per process (a new key frees the old one first), so a long-lived Dask or Ray worker never
holds two 72B models.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from citer.config import Params
from citer.project import Project
from citer.routing.iterations import dir_digest, pair_digests
from citer.routing.labels import Encoded, InProcessWork, encode_rows, rows_hash
from citer.routing.shards import branches_from, run_teacher_forced_shard

T = TypeVar("T")

_LOCK = threading.Lock()  # the local runner's shards are threads of one process: one load, not one per thread
_SLOTS: dict[str, tuple[str, Any]] = {}


class ShardWorkerError(ValueError):
    """A worker that cannot do its shard as the driver would (other model files, other rows)."""


@dataclass(frozen=True)
class ShardContext:
    """What every shard task is sent: small and picklable."""

    root: str  # the project root; workers must see the project at this path (shared volume or the same image)
    params: Params
    digests: dict[str, str]  # the driver's pair_digests: a worker with other model files refuses
    rows_hash: str  # the driver's encoded examples: a worker reading another train file refuses
    n_examples: int  # examples encoded (encode_rows' n_examples)
    router_iteration: int = 0  # routed rollouts use the router of this iteration; 0 = none

    @property
    def project(self) -> Project:
        return Project(root=Path(self.root), params=self.params)


def _cached(slot: str, key: str, load: Callable[[], T]) -> T:
    with _LOCK:
        hit = _SLOTS.get(slot)
        if hit is not None and hit[0] == key:
            return hit[1]
        _SLOTS.pop(slot, None)  # free the previous value before loading its replacement
        value = load()
        _SLOTS[slot] = (key, value)
        return value


def release() -> None:
    """Forget what this process holds (the local runner calls it when collection ends: the driver keeps no pair)."""
    with _LOCK:
        _SLOTS.clear()


def configure_worker(threads: int, gpus: str | None = None) -> None:
    """Torch intra-op threads of this worker (0: leave them) and, before CUDA starts, the GPUs it may use."""
    if gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def gpu_group(rank: int, gpus_per_worker: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of worker ``rank`` on a machine whose GPUs are dealt out in consecutive groups."""
    return ",".join(str(g) for g in range(rank * gpus_per_worker, (rank + 1) * gpus_per_worker))


def worker_pair(ctx: ShardContext) -> tuple[Any, Any, Any]:
    """``(slm, llm, tokenizer)`` of this process, loaded on first use as params say (device, device_map)."""
    proj = ctx.project
    m = ctx.params.models
    key = json.dumps(
        [proj.slm_ref, proj.llm_ref, ctx.digests, m.model_dump(), os.environ.get("CUDA_VISIBLE_DEVICES")],
        sort_keys=True,
        default=str,
    )

    def load() -> tuple[Any, Any, Any]:
        here = pair_digests(proj.slm_ref, proj.llm_ref)
        if here != ctx.digests:
            raise ShardWorkerError(
                f"worker {socket.gethostname()}: models {proj.slm_ref} / {proj.llm_ref} differ from the driver's "
                f"({here} vs {ctx.digests}); give every worker the same model files"
            )
        return proj.load_pair()

    return _cached("pair", key, load)


def worker_examples(ctx: ShardContext, tokenizer: Any) -> tuple[list[dict[str, Any]], list[Encoded]]:
    """The train rows and their encoding, read by the worker and checked against the driver's hash."""
    proj = ctx.project
    p = ctx.params

    def load() -> tuple[list[dict[str, Any]], list[Encoded]]:
        rows = proj.read_split("train")
        enc = encode_rows(tokenizer, rows, p.data.format, ctx.n_examples)
        if rows_hash(enc) != ctx.rows_hash:
            raise ShardWorkerError(
                f"worker {socket.gethostname()}: {proj.path(p.data.train)} encodes to rows_hash "
                f"{rows_hash(enc)}, the driver's is {ctx.rows_hash}; give every worker the same train file"
            )
        return rows, enc

    return _cached("examples", f"{ctx.rows_hash}:{ctx.n_examples}:{proj.path(p.data.train)}", load)


def worker_router(ctx: ShardContext, slm: Any, tokenizer: Any) -> Any:
    """The router of ``ctx.router_iteration``, loaded once per process (its files' digest keys the cache)."""
    from citer.routing.mlp import META_FILE, WEIGHTS_FILE, load_router

    proj = ctx.project
    d = proj.router_dir(ctx.router_iteration)
    key = f"{d}:{dir_digest(d, (WEIGHTS_FILE, META_FILE))}:{ctx.digests}"

    def load() -> Any:
        from citer.routing.pair_check import check_pair

        router, meta = load_router(
            d,
            expected_hidden_size=int(slm.config.hidden_size),
            expected_slm=proj.slm_name,
            slm=slm,  # used only by a router that reads features beyond the hidden state
            vocab_size=len(tokenizer),
        )
        # Rollouts routed by a router of another pair would label this pair's tokens with someone else's choices.
        check_pair(meta, ctx.digests, f"router {proj.portable_ref(d)}", remedy="run `citer router iterate`")
        return router

    return _cached("router", key, load)


def _work(ctx: ShardContext, routed: bool) -> tuple[InProcessWork, list[Encoded]]:
    slm, llm, tok = worker_pair(ctx)
    rows, enc = worker_examples(ctx, tok)
    router = worker_router(ctx, slm, tok) if routed else None
    labels = ctx.params.labels
    work = InProcessWork(
        slm, llm, tok, rows, ctx.params.data.format, router, labels.tau, labels.verify_kwargs
    )
    return work, enc


def teacher_forced_shard(ctx: ShardContext, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """One shard's teacher-forced pass (:func:`citer.routing.shards.run_teacher_forced_shard`)."""
    work, enc = _work(ctx, routed=False)
    labels = ctx.params.labels
    dtype = torch.float16 if labels.hidden_dtype == "float16" else torch.float32
    return run_teacher_forced_shard(work, enc, ids, labels.batch_size, dtype)


def rollout_shard(ctx: ShardContext, branches: torch.Tensor, routed: bool) -> torch.Tensor:
    """One shard's rollouts (``branches``: (n, 3) example, position, token) -> (n,) bool, right answer or not."""
    work, enc = _work(ctx, routed)
    labels = ctx.params.labels
    ok = work.rollouts(enc, branches_from(branches), routed, labels.batch_size, labels.max_new_tokens)
    return torch.tensor(ok, dtype=torch.bool)


def slm_hidden_size(proj: Project) -> int:
    """The SLM's hidden size from its config alone: the driver of a sharded run loads no weights."""
    from citer.models.loading import load_config

    cfg = load_config(proj.slm_ref, trust_remote_code=proj.params.models.trust_remote_code)
    return int(cfg.get_text_config().hidden_size)
