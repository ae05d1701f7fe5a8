"""Cost meter for routed decoding: tokens by model, LLM calls, catch-up tokens, bytes moved, projected GPU time.

Decoding a few rows at a time is memory-bound on a GPU: a forward call costs about the bytes it moves
(docs/cost_model.md defines every term and what each method is charged):

    bytes(call of model M over rows R) = W_M + sum_{r in R} kv_M * (ctx_r + new_r)

``W_M``: the weight bytes read once per call (an untied input embedding left out; the SLM's includes the router's
reads, since the router runs at every SLM step); ``kv_M``: K and V bytes of one token over all layers; ``ctx_r``: the
cache columns row r attends after the call (the KV read); ``new_r``: its tokens fed in the call (the KV written).

Per row, a call's weight read is split evenly among its rows, so per-row bytes sum exactly to the batch's.
``bytes_alone`` prices the row's calls as if it had been decoded alone (batch 1, every call reads the whole weights):
exact, not an estimate, because a row's output does not depend on its batch. A row held back while it waits for a
shared LLM call rides along in the SLM's calls: the KV it attends counts in its ``bytes_moved``, not in
``bytes_alone``. Projected GPU time = bytes / the named GPU's bandwidth (:data:`GPU_BANDWIDTH`); compute, launch and
Python overheads are not in it, and the measured wall time is reported beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
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
    wait_steps: int = 0  # decoding steps this row spent waiting for a shared LLM call
    rolled_back_tokens: int = 0  # provisional SLM tokens a verified catch-up took back (not in new_tokens)
    # KV token-columns this row's own calls moved (context + new, per call), the counts ``bytes_alone`` multiplies by
    # each model's ``kv_bytes_per_token``: with the calls they re-price the row at another pair's shapes.
    slm_kv_tokens: int = 0
    llm_kv_tokens: int = 0


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
    llm_calls_per_token: float  # llm_calls / new_tokens; <= llm_fraction unless check calls keep SLM tokens
    decode_steps: int = 0  # scheduler steps (each: at most one SLM decode call and one LLM call)
    llm_calls_per_step: float = 0.0  # how often a step reads the LLM's weights
    wait_row_steps: int = 0  # row-steps spent waiting for a shared LLM call (the latency shared calls add)
    wait_steps_per_llm_token: float = 0.0
    rolled_back_tokens: int = 0
    # steps whose SLM call was queued while their LLM call was in flight (engine.overlap)
    overlapped_steps: int = 0


_ROW_FIELDS = ("calls", "wshare", "kv", "kv_idle", "tokens")
_FEW = 4  # up to this many rows, counters are updated entry by entry


def _add(a: np.ndarray, rows: Sequence[int], values: Sequence[float] | np.ndarray | float) -> None:
    """``a[rows] += values`` counting every entry: a row may repeat (a draft's tokens arrive together), where
    numpy's fancy ``+=`` would count it once. A handful of rows go entry by entry: numpy's per-call cost would be most
    of a batch-1 step's bookkeeping."""
    one = isinstance(values, int | float)
    if len(rows) > _FEW:
        np.add.at(a, np.asarray(rows, dtype=np.int64), values if one else np.asarray(values))
    elif one:
        for r in rows:
            a[r] += values
    else:
        for r, v in zip(rows, values, strict=True):  # type: ignore[arg-type]
            a[r] += v


class CostMeter:
    """Accumulates the cost of a decoding session; rows are numbered in the order they join (``add_rows``)."""

    def __init__(self, slm: ModelCost, llm: ModelCost | None, n_rows: int = 0, gpu: str = "H100") -> None:
        if gpu not in GPU_BANDWIDTH:
            raise ValueError(f"unknown gpu {gpu!r}; expected one of {sorted(GPU_BANDWIDTH)}")
        self.costs: dict[str, ModelCost | None] = {"slm": slm, "llm": llm}
        self.gpu = gpu
        self.n = 0
        self.calls = {"slm": 0, "llm": 0}
        self.steps = 0
        self.overlapped = 0
        # Per model and field, one entry per row: calls, weight share (in units of W), kv token-columns moved
        # (kv_idle: while held), tokens emitted.
        self._row: dict[tuple[str, str], np.ndarray] = {}
        self._alloc = 0
        self._grow(max(n_rows, 1))
        self.llm_prompt = np.zeros(self._alloc, dtype=np.int64)
        self.llm_catchup = np.zeros(self._alloc, dtype=np.int64)
        self.wait = np.zeros(self._alloc, dtype=np.int64)
        self.rolled = np.zeros(self._alloc, dtype=np.int64)
        self.add_rows(n_rows)

    def _grow(self, alloc: int) -> None:
        def grown(a: np.ndarray | None, dtype: type) -> np.ndarray:
            out = np.zeros(alloc, dtype=dtype)
            if a is not None:
                out[: len(a)] = a
            return out

        for m in ("slm", "llm"):
            for f in _ROW_FIELDS:
                self._row[m, f] = grown(self._row.get((m, f)), np.float64 if f == "wshare" else np.int64)
        for name in ("llm_prompt", "llm_catchup", "wait", "rolled"):
            if hasattr(self, name):
                setattr(self, name, grown(getattr(self, name), np.int64))
        self._alloc = alloc

    def add_rows(self, k: int) -> list[int]:
        """Rows joining the session; returns their indices."""
        if self.n + k > self._alloc:
            self._grow(max(self.n + k, 2 * self._alloc))
        self.n += k
        return list(range(self.n - k, self.n))

    def forward(
        self, model: ModelKey, rows: Sequence[int], new_tokens: Sequence[int], context: Sequence[int]
    ) -> None:
        """One forward call of ``model`` over ``rows``: row r fed ``new_tokens[i]`` and attends ``context[i]``."""
        self.calls[model] += 1
        _add(self._row[model, "calls"], rows, 1)
        _add(self._row[model, "wshare"], rows, 1.0 / len(rows))
        _add(self._row[model, "kv"], rows, [c + n for c, n in zip(context, new_tokens, strict=True)])

    def held(self, model: ModelKey, rows: Sequence[int], context: Sequence[int]) -> None:
        """Rows that rode along in the last call of ``model`` without advancing (their KV was read)."""
        _add(self._row[model, "kv_idle"], rows, context)

    def llm_fed(
        self, rows: Sequence[int], prompt_tokens: Sequence[int], catchup_tokens: Sequence[int]
    ) -> None:
        _add(self.llm_prompt, rows, prompt_tokens)
        _add(self.llm_catchup, rows, catchup_tokens)

    def emitted(self, rows: Sequence[int], from_llm: Sequence[bool]) -> None:
        _add(self._row["llm", "tokens"], [r for r, f in zip(rows, from_llm, strict=True) if f], 1)
        _add(self._row["slm", "tokens"], [r for r, f in zip(rows, from_llm, strict=True) if not f], 1)

    def rolled_back(self, rows: Sequence[int], n_tokens: Sequence[int]) -> None:
        """Rows whose last ``n_tokens`` emitted SLM tokens were taken back: they leave the token counts; the calls
        that wrote them (SLM steps, router reads, the LLM's KV writes past the cut) stay charged."""
        _add(self._row["slm", "tokens"], rows, [-n for n in n_tokens])
        _add(self.rolled, rows, n_tokens)

    def step(self, waiting: Sequence[int], overlapped: bool = False) -> None:
        """One scheduler step ended; ``waiting`` rows were held back by a shared LLM call; ``overlapped``: its SLM
        call was queued while its LLM call was in flight."""
        self.steps += 1
        self.overlapped += overlapped
        if waiting:
            _add(self.wait, waiting, 1)

    def _bytes(self, model: str) -> np.ndarray:
        cost = self.costs[model]
        if cost is None:
            return np.zeros(self.n, dtype=np.float64)
        kv = self._row[model, "kv"][: self.n] + self._row[model, "kv_idle"][: self.n]
        return self._row[model, "wshare"][: self.n] * cost.weight_bytes + kv.astype(np.float64) * (
            cost.kv_bytes_per_token
        )

    def _bytes_alone(self) -> np.ndarray:
        out = np.zeros(self.n, dtype=np.float64)
        for model, cost in self.costs.items():
            if cost is not None:
                out += self._row[model, "calls"][: self.n] * float(cost.weight_bytes)
                out += self._row[model, "kv"][: self.n].astype(np.float64) * cost.kv_bytes_per_token
        return out

    def row_stats(self, rows: Sequence[int] | None = None) -> list[RowStats]:
        """Stats of ``rows`` (default: every row) as they stand now."""
        bw = GPU_BANDWIDTH[self.gpu]
        sb, lb, alone = self._bytes("slm"), self._bytes("llm"), self._bytes_alone()
        out = []
        for r in range(self.n) if rows is None else rows:
            st, lt = int(self._row["slm", "tokens"][r]), int(self._row["llm", "tokens"][r])
            out.append(
                RowStats(
                    new_tokens=st + lt,
                    slm_tokens=st,
                    llm_tokens=lt,
                    slm_calls=int(self._row["slm", "calls"][r]),
                    llm_calls=int(self._row["llm", "calls"][r]),
                    llm_prompt_tokens=int(self.llm_prompt[r]),
                    llm_catchup_tokens=int(self.llm_catchup[r]),
                    slm_bytes=float(sb[r]),
                    llm_bytes=float(lb[r]),
                    bytes_moved=float(sb[r] + lb[r]),
                    projected_seconds=float((sb[r] + lb[r]) / bw),
                    bytes_alone=float(alone[r]),
                    wait_steps=int(self.wait[r]),
                    rolled_back_tokens=int(self.rolled[r]),
                    slm_kv_tokens=int(self._row["slm", "kv"][r]),
                    llm_kv_tokens=int(self._row["llm", "kv"][r]),
                )
            )
        return out

    def finish(self, wall_seconds: float) -> tuple[list[RowStats], BatchStats]:
        bw = GPU_BANDWIDTH[self.gpu]
        rows = self.row_stats()
        n = self.n
        sb, lb = self._bytes("slm").sum(), self._bytes("llm").sum()
        slm_t, llm_t = int(self._row["slm", "tokens"][:n].sum()), int(self._row["llm", "tokens"][:n].sum())
        new = slm_t + llm_t
        total = float(sb + lb)
        proj = total / bw
        waited = int(self.wait[:n].sum())
        batch = BatchStats(
            rows=n,
            new_tokens=new,
            slm_tokens=slm_t,
            llm_tokens=llm_t,
            slm_calls=self.calls["slm"],
            llm_calls=self.calls["llm"],
            llm_prompt_tokens=int(self.llm_prompt[:n].sum()),
            llm_catchup_tokens=int(self.llm_catchup[:n].sum()),
            slm_bytes=float(sb),
            llm_bytes=float(lb),
            bytes_moved=total,
            wall_seconds=float(wall_seconds),
            gpu=self.gpu,
            projected_seconds=proj,
            projected_seconds_per_token=proj / max(new, 1),
            wall_seconds_per_token=float(wall_seconds) / max(new, 1),
            llm_fraction=llm_t / max(new, 1),
            llm_calls_per_token=self.calls["llm"] / max(new, 1),
            decode_steps=self.steps,
            llm_calls_per_step=self.calls["llm"] / max(self.steps, 1),
            wait_row_steps=waited,
            wait_steps_per_llm_token=waited / max(llm_t, 1),
            rolled_back_tokens=int(self.rolled[:n].sum()),
            overlapped_steps=self.overlapped,
        )
        return rows, batch


@dataclass
class CallTally:
    """Forward calls of two models and the KV columns each moved, ``[calls, columns]`` per model, counted as
    :class:`CostMeter` charges them (the context after the call read, the new tokens written): for decoders the
    engine does not run (transformers' assisted generation)."""

    slm: list[int] = field(default_factory=lambda: [0, 0])
    llm: list[int] = field(default_factory=lambda: [0, 0])

    def reset(self) -> None:
        self.slm[:], self.llm[:] = [0, 0], [0, 0]

    def bytes(self, costs: tuple[ModelCost, ModelCost], batch: int = 1) -> float:
        """The bytes those calls moved at ``costs`` (SLM, LLM), ``batch`` rows each."""
        return float(sum(c.weight_bytes * n + batch * c.kv_bytes_per_token * kv
                         for c, (n, kv) in zip(costs, (self.slm, self.llm), strict=True)))  # fmt: skip


@contextlib.contextmanager
def forward_calls(slm: Any, llm: Any, on_call: Callable[[str, int, int], None]) -> Iterator[None]:
    """For the block, ``on_call(model, new, seen)`` at every forward call of ``slm`` ("slm") and ``llm`` ("llm"),
    HF modules' calls: ``new`` tokens fed over ``seen`` cached ones (decoders the engine does not run)."""

    def hook(which: str) -> Any:
        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = kwargs.get("past_key_values")
            on_call(which, int(ids.shape[1]), int(past.get_seq_length()) if past is not None else 0)

        return pre

    handles = [
        m.register_forward_pre_hook(hook(w), with_kwargs=True) for w, m in (("slm", slm), ("llm", llm))
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def call_tally(slm: Any, llm: Any) -> Iterator[CallTally]:
    """For the block, a :class:`CallTally` of every forward call of ``slm`` and ``llm`` (HF modules' calls)."""
    tally = CallTally()

    def count(which: str, new: int, seen: int) -> None:
        acc = tally.slm if which == "slm" else tally.llm
        acc[0] += 1
        acc[1] += (seen + new) + new  # the context after the call is read, the new columns written

    with forward_calls(slm, llm, count):
        yield tally
