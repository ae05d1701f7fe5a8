"""Every sweep row priced at a reference pair too: the same calls at another pair's weight and KV bytes.

A row's measured bytes price the calls the engine made with the pair that ran (:mod:`citer.decoding.cost`). The
embedded pair's proportions are not a real pair's (its LLM is ~12x its SLM, its router a large share of the SLM), so
each pass also records, per question, what those bytes are made of -- :class:`CallCounts`: the SLM's and the LLM's
calls, the KV token-columns each model's calls moved (context + new tokens per call, rollbacks and check calls
included) and the SLM calls that also read a router -- and prices the same counts at a reference pair
(``sweep.price_at``):

    priced = slm_calls * W_slm + router_calls * R + slm_kv * kv_slm + llm_calls * W_llm + llm_kv * kv_llm

``W`` and ``kv`` come from :func:`shape_cost`, exactly what :meth:`ModelCost.from_model` gives for a model of those
shapes; ``R`` is the router's read at the reference SLM's hidden size (:class:`RouterShape`: the same layers as
multiples of the hidden size, the same inputs). Priced with the pair that ran, the counts give back the measured
bytes exactly (:func:`check_measured`), so the priced column is the measured decoding, re-priced, and nothing else.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from citer.config import ModelShapeParams, PriceAtParams
from citer.decoding.cost import ModelCost, RowStats
from citer.evaluation.sweep_rows import SweepRow
from citer.routing.architecture import MLPRouter
from citer.routing.features import DEFAULT_LOGIT_K, FeatureRouter, input_dim, normalize_features


class PricingError(ValueError):
    """Counts that do not give back the measured bytes: the re-pricing would not be of the same decoding."""


@dataclass(frozen=True)
class CallCounts:
    """One question's calls as the meter charged them at batch 1."""

    slm_calls: int = 0
    slm_kv: int = (
        0  # KV token-columns the SLM's calls moved: per call, its context after the call + its new tokens
    )
    llm_calls: int = 0
    llm_kv: int = 0
    router_calls: int = 0  # SLM calls that also read a router (0 for a router that reads nothing)

    def __add__(self, other: CallCounts) -> CallCounts:
        return CallCounts(
            self.slm_calls + other.slm_calls,
            self.slm_kv + other.slm_kv,
            self.llm_calls + other.llm_calls,
            self.llm_kv + other.llm_kv,
            self.router_calls + other.router_calls,
        )

    @classmethod
    def of_row(cls, st: RowStats, solo_llm: bool = False, reads_router: bool = True) -> CallCounts:
        """A routed engine's row; ``solo_llm``: the LLM decoded alone in the SLM's seat (its calls are the LLM's)."""
        if solo_llm:
            return cls(llm_calls=int(st.slm_calls), llm_kv=int(st.slm_kv_tokens))
        return cls(
            int(st.slm_calls),
            int(st.slm_kv_tokens),
            int(st.llm_calls),
            int(st.llm_kv_tokens),
            int(st.slm_calls) if reads_router else 0,
        )


def shape_cost(shape: ModelShapeParams, dtype_bytes: int) -> ModelCost:
    """What :meth:`ModelCost.from_model` gives for a model of ``shape`` in ``dtype_bytes`` per element: every
    parameter but an untied input embedding (so the vocabulary is read once, by the head, tied or not), and K and V
    of one token over all layers."""
    h, q, kv = (
        shape.hidden_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_key_value_heads * shape.head_dim,
    )
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if shape.attention_bias else 0)
    layer = attention + 3 * h * shape.intermediate_size + 2 * h  # + gate, up, down and two RMSNorms
    weights = shape.num_hidden_layers * layer + h + shape.vocab_size * h  # + the final norm and the head
    return ModelCost(
        weight_bytes=int(weights * dtype_bytes),
        kv_bytes_per_token=int(2 * shape.num_hidden_layers * kv * dtype_bytes),
    )


@dataclass(frozen=True)
class RouterShape:
    """What a router reads per call, as a function of the SLM's hidden size, so it can be priced at any pair.

    ``mlp``: :class:`citer.routing.mlp.MLPRouter` (its hidden layers as multiples of the hidden size, its inputs,
    BatchNorm statistics included) plus one embedding row when it reads the token's embedding; ``query``: the query
    router's standardise-and-dot over the SLM's mean hidden state (mean, std, weight, bias); ``none``: nothing beyond
    the SLM's own weights (confidence reads the SLM's head, random and the oracle read nothing)."""

    kind: Literal["none", "mlp", "query"] = "none"
    widths: tuple[float, ...] = ()
    features: tuple[str, ...] = ("hidden",)
    logit_k: int = DEFAULT_LOGIT_K

    def read_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        if self.kind == "none":
            return 0
        if self.kind == "query":
            return dtype_bytes * (3 * hidden_size + 1)
        n, prev = 0, input_dim(hidden_size, self.features, self.logit_k)
        for m in self.widths:
            w = max(1, round(m * hidden_size))
            n += prev * w + w + 4 * w  # Linear, then BatchNorm's weight, bias and running mean and variance
            prev = w
        n += prev + 1
        if "token_embedding" in self.features:
            n += hidden_size
        return int(n * dtype_bytes)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "widths": list(self.widths), "features": list(self.features)}


def router_shape(router: Any) -> RouterShape:
    """The shape of a router the engine runs: an MLP router (or a feature router around one), or none."""
    feats, k, mlp = ("hidden",), DEFAULT_LOGIT_K, router
    if isinstance(router, FeatureRouter):
        feats, k, mlp = normalize_features(router.features), router.logit_k, router.mlp
    if isinstance(mlp, MLPRouter):
        h = mlp.hidden_size
        return RouterShape("mlp", tuple(w / h for w in mlp.widths), feats, k)
    return RouterShape("none")


@dataclass(frozen=True)
class Pricing:
    """A pair's prices: each model's cost per call and per KV column, and its SLM's hidden size and element size
    (where a router's read is priced)."""

    name: str
    slm: ModelCost
    llm: ModelCost
    hidden_size: int
    dtype_bytes: int

    @classmethod
    def reference(cls, p: PriceAtParams) -> Pricing:
        return cls(p.name, shape_cost(p.slm, p.dtype_bytes), shape_cost(p.llm, p.dtype_bytes), p.slm.hidden_size,
                   p.dtype_bytes)  # fmt: skip

    @classmethod
    def measured(cls, slm: Any, llm: Any) -> Pricing:
        """The pair that ran, as the engine prices it."""
        elt = next(iter(slm.parameters())).element_size()
        llm_cost = ModelCost.from_model(llm) if llm is not None else ModelCost(0, 0)
        return cls("measured", ModelCost.from_model(slm), llm_cost, int(slm.config.hidden_size), elt)

    @classmethod
    def of_costs(cls, slm: Any, slm_cost: ModelCost, llm_cost: ModelCost | None) -> Pricing:
        """The pair that ran, at other per-call costs than its torch models' (the GGUF files a llama.cpp runner
        decoded); the router's read stays the torch SLM's dtype, where the router runs."""
        elt = next(iter(slm.parameters())).element_size()
        return cls("measured", slm_cost, llm_cost or ModelCost(0, 0), int(slm.config.hidden_size), elt)

    def price(self, counts: CallCounts, router_bytes: int) -> float:
        """Bytes of ``counts`` at this pair; ``router_bytes``: what each router-reading call reads here."""
        return float(
            counts.slm_calls * self.slm.weight_bytes
            + counts.router_calls * router_bytes
            + counts.slm_kv * self.slm.kv_bytes_per_token
            + counts.llm_calls * self.llm.weight_bytes
            + counts.llm_kv * self.llm.kv_bytes_per_token
        )

    def price_all(self, counts: Sequence[CallCounts], shape: RouterShape) -> list[float]:
        r = shape.read_bytes(self.hidden_size, self.dtype_bytes)
        return [self.price(c, r) for c in counts]


def check_measured(
    counts: Sequence[CallCounts], measured: Sequence[float], pair: Pricing, router_bytes: int, what: str
) -> None:
    """Refuse counts that, priced at the pair that ran, do not give back the measured bytes of every question."""
    for i, (c, b) in enumerate(zip(counts, measured, strict=True)):
        got = pair.price(c, router_bytes)
        if not math.isclose(got, b, rel_tol=1e-9, abs_tol=1e-6):
            raise PricingError(
                f"{what}: question {i}: calls {c} price to {got:.0f} bytes at the pair that ran, the meter charged "
                f"{b:.0f}; the priced column would not be the same decoding"
            )


def router_share(shape: RouterShape, pair: Pricing, router_bytes: int | None = None) -> dict[str, float]:
    """The router's read per step against the SLM's weight read per call at ``pair`` (``router_bytes``: the measured
    read, else the shape's at this pair)."""
    r = shape.read_bytes(pair.hidden_size, pair.dtype_bytes) if router_bytes is None else router_bytes
    return {"router_bytes": float(r), "slm_weight_bytes": float(pair.slm.weight_bytes),
            "share_of_slm": r / pair.slm.weight_bytes if pair.slm.weight_bytes else math.nan}  # fmt: skip


def priced_view(rows: Sequence[SweepRow]) -> list[SweepRow] | None:
    """Copies of ``rows`` whose byte fields are the priced ones (bytes, relative bytes, per-question bytes and their
    interval), so every claim and interval computed on measured rows is computed the same way at the reference pair.
    None when some row has no priced bytes (a sweep without ``price_at``, or rows read from older files)."""
    if not rows or any(r.bytes_priced is None or r.bytes_priced_rel_llm is None for r in rows):
        return None
    out = []
    for r in rows:
        c = copy.copy(r)
        c.bytes_moved, c.bytes_moved_rel_llm = float(r.bytes_priced), float(r.bytes_priced_rel_llm)  # type: ignore[arg-type]
        c.question_bytes, c.bytes_ci = list(r.question_bytes_priced), r.bytes_priced_ci
        out.append(c)
    return out


def labelled(found: Any, name: str) -> Any:
    """Claims (as :func:`citer.evaluation.pareto.claims` writes them) with every statement saying where it is
    priced: ``Priced at <pair>: ...``."""
    if isinstance(found, dict):
        return {k: (f"Priced at {name}: {v}" if k == "statement" and isinstance(v, str) else labelled(v, name))
                for k, v in found.items()}  # fmt: skip
    if isinstance(found, list):
        return [labelled(v, name) for v in found]
    return found
