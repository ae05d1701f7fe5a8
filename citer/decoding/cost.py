"""Cost meter for routed decoding: tokens by model, LLM calls, catch-up tokens, bytes moved, projected GPU time.

Decoding a few rows at a time is memory-bound on a GPU: a forward call costs about the bytes it moves. The model:

    bytes(call of model M over rows R) = W_M + sum_{r in R} kv_M * (ctx_r + new_r)

- ``W_M``: weight bytes read once per forward call = bytes of every parameter of M, minus the input embedding table
  when it is not tied to the output head (a lookup reads only the rows it needs, which we neglect). The SLM's ``W``
  includes the router's reads (its MLP, any embedding row it looks up), since the router runs at every SLM step.
- ``kv_M``: K and V bytes of one token over all layers = 2 * layers * kv_heads * head_dim * dtype_bytes.
- ``ctx_r``: cache columns row r attends to after the call (its whole sequence so far, new tokens included) -- the
  KV read; ``new_r``: tokens fed for row r in this call -- the KV written.

Per-row accounting splits the weight read evenly among the rows of the call, so per-row bytes sum exactly to the
batch bytes:

    bytes_r = sum over calls c containing r of ( W_M / |R_c| + kv_M * (ctx_r + new_r) )

``bytes_alone`` prices the same calls as if the row had been decoded by itself (batch 1, the latency regime the
CITER paper measures): ``sum over calls c containing r of ( W_M + kv_M * (ctx_r + new_r) )``. Because the engine's
output for a row does not depend on its batch, this is exact, not an estimate.

Projected GPU time = bytes / bandwidth of the named GPU (``GPU_BANDWIDTH``, bytes/s: H100 3.35e12, H200 4.8e12);
per token it is batch bytes / bandwidth / tokens generated in the batch. Compute, launch and Python overheads are not
in the projection; wall time (measured) is reported beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch

GPU_BANDWIDTH: dict[str, float] = {"H100": 3.35e12, "H200": 4.8e12}

ModelKey = Literal["slm", "llm"]


@dataclass(frozen=True)
class ModelCost:
    """What one forward call of a model moves, from its config and dtype."""

    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelCost:
        params = {id(p): p for p in model.parameters()}  # tied tensors count once
        weight = sum(p.numel() * p.element_size() for p in params.values())
        emb_in = model.get_input_embeddings()
        emb_out = model.get_output_embeddings()
        if emb_in is not None and (emb_out is None or emb_in.weight is not emb_out.weight):
            weight -= emb_in.weight.numel() * emb_in.weight.element_size()
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        elt = next(iter(params.values())).element_size()
        kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elt
        return cls(weight_bytes=int(weight), kv_bytes_per_token=int(kv))

    def plus(self, extra_weight_bytes: int) -> ModelCost:
        """This model with ``extra_weight_bytes`` more read at every call (the router, run at every SLM step)."""
        return ModelCost(self.weight_bytes + int(extra_weight_bytes), self.kv_bytes_per_token)


@dataclass
class RowStats:
    """One row's share of a generation. ``bytes_moved = slm_bytes + llm_bytes``."""

    new_tokens: int
    slm_tokens: int
    llm_tokens: int
    slm_calls: int
    llm_calls: int
    llm_prompt_tokens: int  # prompt tokens the LLM prefilled for this row (0 if it never ran on it)
    llm_catchup_tokens: int  # generated tokens fed to the LLM (tokens it had not seen at its previous call)
    slm_bytes: float
    llm_bytes: float
    bytes_moved: float
    projected_seconds: float
    # The same calls as if this row were decoded alone (batch 1): every call reads the whole weights.
    bytes_alone: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BatchStats:
    """Totals over a batch. ``*_calls`` count batched forward calls (one call over many rows counts once)."""

    rows: int
    new_tokens: int
    slm_tokens: int
    llm_tokens: int
    slm_calls: int
    llm_calls: int
    llm_prompt_tokens: int
    llm_catchup_tokens: int
    slm_bytes: float
    llm_bytes: float
    bytes_moved: float
    wall_seconds: float
    gpu: str
    projected_seconds: float
    projected_seconds_per_token: float
    wall_seconds_per_token: float
    llm_fraction: float  # llm_tokens / new_tokens
    llm_calls_per_token: float  # llm_calls / new_tokens; <= llm_fraction by construction

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CostMeter:
    """Accumulates the cost of one ``generate_batch`` call; rows are indexed as in the caller's prompt list."""

    def __init__(self, slm: ModelCost, llm: ModelCost | None, n_rows: int, gpu: str = "H100") -> None:
        if gpu not in GPU_BANDWIDTH:
            raise ValueError(f"unknown gpu {gpu!r}; expected one of {sorted(GPU_BANDWIDTH)}")
        self.costs: dict[str, ModelCost | None] = {"slm": slm, "llm": llm}
        self.gpu = gpu
        self.n = n_rows
        self.calls = {"slm": 0, "llm": 0}
        # Per row, per model: calls, weight share (in units of W), kv token-columns moved.
        self.row_calls = {k: np.zeros(n_rows, dtype=np.int64) for k in ("slm", "llm")}
        self.row_wshare = {k: np.zeros(n_rows, dtype=np.float64) for k in ("slm", "llm")}
        self.row_kv = {k: np.zeros(n_rows, dtype=np.int64) for k in ("slm", "llm")}
        self.tokens = {k: np.zeros(n_rows, dtype=np.int64) for k in ("slm", "llm")}
        self.llm_prompt = np.zeros(n_rows, dtype=np.int64)
        self.llm_catchup = np.zeros(n_rows, dtype=np.int64)

    def forward(
        self, model: ModelKey, rows: Sequence[int], new_tokens: Sequence[int], context: Sequence[int]
    ) -> None:
        """One forward call of ``model`` over ``rows``: row r fed ``new_tokens[i]`` and attends ``context[i]``."""
        idx = np.asarray(rows, dtype=np.int64)
        self.calls[model] += 1
        self.row_calls[model][idx] += 1
        self.row_wshare[model][idx] += 1.0 / len(idx)
        self.row_kv[model][idx] += np.asarray(context, dtype=np.int64) + np.asarray(
            new_tokens, dtype=np.int64
        )

    def llm_fed(
        self, rows: Sequence[int], prompt_tokens: Sequence[int], catchup_tokens: Sequence[int]
    ) -> None:
        idx = np.asarray(rows, dtype=np.int64)
        self.llm_prompt[idx] += np.asarray(prompt_tokens, dtype=np.int64)
        self.llm_catchup[idx] += np.asarray(catchup_tokens, dtype=np.int64)

    def emitted(self, rows: Sequence[int], from_llm: Sequence[bool]) -> None:
        idx = np.asarray(rows, dtype=np.int64)
        llm = np.asarray(from_llm, dtype=bool)
        self.tokens["llm"][idx[llm]] += 1
        self.tokens["slm"][idx[~llm]] += 1

    def _bytes(self, model: str) -> np.ndarray:
        cost = self.costs[model]
        if cost is None:
            return np.zeros(self.n, dtype=np.float64)
        return self.row_wshare[model] * cost.weight_bytes + self.row_kv[model].astype(np.float64) * (
            cost.kv_bytes_per_token
        )

    def _bytes_alone(self) -> np.ndarray:
        out = np.zeros(self.n, dtype=np.float64)
        for model, cost in self.costs.items():
            if cost is not None:
                out += self.row_calls[model] * float(cost.weight_bytes)
                out += self.row_kv[model].astype(np.float64) * cost.kv_bytes_per_token
        return out

    def finish(self, wall_seconds: float) -> tuple[list[RowStats], BatchStats]:
        bw = GPU_BANDWIDTH[self.gpu]
        sb, lb = self._bytes("slm"), self._bytes("llm")
        alone = self._bytes_alone()
        rows = []
        for r in range(self.n):
            st, lt = int(self.tokens["slm"][r]), int(self.tokens["llm"][r])
            rows.append(
                RowStats(
                    new_tokens=st + lt,
                    slm_tokens=st,
                    llm_tokens=lt,
                    slm_calls=int(self.row_calls["slm"][r]),
                    llm_calls=int(self.row_calls["llm"][r]),
                    llm_prompt_tokens=int(self.llm_prompt[r]),
                    llm_catchup_tokens=int(self.llm_catchup[r]),
                    slm_bytes=float(sb[r]),
                    llm_bytes=float(lb[r]),
                    bytes_moved=float(sb[r] + lb[r]),
                    projected_seconds=float((sb[r] + lb[r]) / bw),
                    bytes_alone=float(alone[r]),
                )
            )
        new = int(self.tokens["slm"].sum() + self.tokens["llm"].sum())
        total = float(sb.sum() + lb.sum())
        proj = total / bw
        batch = BatchStats(
            rows=self.n,
            new_tokens=new,
            slm_tokens=int(self.tokens["slm"].sum()),
            llm_tokens=int(self.tokens["llm"].sum()),
            slm_calls=self.calls["slm"],
            llm_calls=self.calls["llm"],
            llm_prompt_tokens=int(self.llm_prompt.sum()),
            llm_catchup_tokens=int(self.llm_catchup.sum()),
            slm_bytes=float(sb.sum()),
            llm_bytes=float(lb.sum()),
            bytes_moved=total,
            wall_seconds=float(wall_seconds),
            gpu=self.gpu,
            projected_seconds=proj,
            projected_seconds_per_token=proj / max(new, 1),
            wall_seconds_per_token=float(wall_seconds) / max(new, 1),
            llm_fraction=int(self.tokens["llm"].sum()) / max(new, 1),
            llm_calls_per_token=self.calls["llm"] / max(new, 1),
        )
        return rows, batch
