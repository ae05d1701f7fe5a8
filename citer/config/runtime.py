"""Block ``runtime``: where the costly work (label collection's teacher-forced passes and rollouts) runs.

``task_runner: local`` runs the shards as Prefect tasks in this process (threads sharing one loaded pair); ``dask``
and ``ray`` run them on the workers of a cluster, a local one of ``workers`` processes when ``address`` is null.
Every runner gives byte-identical labels (docs/scale_out.md), so where to run is the environment's business: the
``CITER_RUNTIME`` environment variable (a YAML mapping such as ``{task_runner: dask, address: tcp://s:8786}``)
overrides the file's keys, as ``MLFLOW_TRACKING_URI`` does for the tracking store (a deployment's worker sets it).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from citer.config.base import _Block, _FieldError

TASK_RUNNERS = ("local", "dask", "ray")
ENV_OVERRIDE = "CITER_RUNTIME"
# A scheduler / head address: no whitespace, a scheme (tcp://, tls://, ray://) or host:port, or ray's "auto".
_ADDRESS = re.compile(r"(auto|[a-z][a-z0-9+.-]*://\S+|[\w.-]+:\d+)")


class RuntimeParams(_Block):
    """The task runner of label collection and how its workers are shaped."""

    task_runner: Literal["local", "dask", "ray"] = "local"
    # local: threads; dask/ray without address: worker processes of a local cluster; with address: shards are cut
    # for this many workers (the cluster's own size decides where they run). A one-thread stage also runs its
    # independent jobs (the bootstrap's two models, each label set's routers) on this many local processes.
    workers: int = Field(1, ge=1, le=1024)
    address: str | None = None  # dask: tcp://host:8786; ray: ray://host:10001 or auto; null = a local cluster
    gpus_per_worker: int = Field(0, ge=0, le=64)  # 0 = CPU; >0: each shard task asks for this many GPUs
    threads_per_worker: int = Field(
        1, ge=0, le=1024
    )  # torch intra-op threads in a dask/ray worker; 0 = default
    shards_per_worker: int = Field(1, ge=1, le=64)  # more, smaller shards even out long and short examples
    # torch threads of each stage in the command's own process: 0 = auto (citer.ops.threads: one for models under
    # 64 MB of weights, else the cores free when the stage starts)
    stage_threads: int = Field(0, ge=0, le=1024)

    @model_validator(mode="before")
    @classmethod
    def _environment_wins(cls, data: Any) -> Any:
        raw = os.environ.get(ENV_OVERRIDE, "").strip()
        if not raw:
            return data
        try:
            over = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ValueError(f"{ENV_OVERRIDE}: not valid YAML ({exc})") from exc
        if not isinstance(over, dict):
            raise ValueError(f"{ENV_OVERRIDE}: must be a mapping of runtime keys, got {raw!r}")
        return {**(data if isinstance(data, dict) else {}), **over}

    @model_validator(mode="after")
    def _coherent(self) -> RuntimeParams:
        if self.address is not None:
            if self.task_runner == "local":
                raise _FieldError("address", self.address, "must be null when task_runner is local")
            if not _ADDRESS.fullmatch(self.address):
                raise _FieldError(
                    "address", self.address, "must be scheme://host:port, host:port or auto (ray), or null"
                )
        if self.gpus_per_worker and self.task_runner == "local":
            raise _FieldError(
                "gpus_per_worker",
                self.gpus_per_worker,
                "must be 0 when task_runner is local (the process places models by models.device)",
            )
        return self

    @property
    def n_shards(self) -> int:
        """How many shards the work is cut into (fewer when there are fewer batches)."""
        return self.workers * self.shards_per_worker
