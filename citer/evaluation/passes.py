"""One decoding pass over the sweep's examples: decode, grade, aggregate into a :class:`SweepRow`.

Every method of the sweep is a pass (or, for query-level routing, a per-question pick from two passes), so all of
them are decoded from the same prompt ids, graded by the same function and priced by the same cost model.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from citer.data.answers import grade
from citer.data.formats import Format
from citer.data.origin import origin
from citer.data.prompts import build_prompt
from citer.decoding.cost import GPU_BANDWIDTH
from citer.decoding.speculative import SpeculativeOutput
from citer.evaluation.pricing import CallCounts, Pricing, RouterShape, check_measured, router_shape
from citer.evaluation.sweep_rows import SweepError, SweepRow
from citer.ops.progress import progress


@dataclass
class PassResult:
    """Per-example outcomes of decoding every example once (lists indexed like the examples)."""

    correct: list[bool]
    n_tokens: list[int]
    llm_tokens: list[int]
    llm_calls: list[int]
    bytes_moved: list[float]
    wall_seconds: float
    gpu_seconds: float  # projected (bytes / bandwidth) at batch 1, see citer.decoding.cost
    tokens: list[list[int]] = field(default_factory=list)
    # Per question, bytes with the weight reads shared by the decoding batch (the batch-shared regime, reported
    # in its own columns; every comparison uses ``bytes_moved``, priced as if each question were decoded alone).
    batch_bytes: list[float] = field(default_factory=list)
    rolled_back: list[int] = field(default_factory=list)  # verified routing: SLM tokens a check took back
    # Per question, the calls ``bytes_moved`` prices (citer.evaluation.pricing), and the same calls priced at the
    # reference pair (``sweep.price_at``; empty when off).
    counts: list[CallCounts] = field(default_factory=list)
    priced_bytes: list[float] = field(default_factory=list)

    def subset(self, idx: Sequence[int]) -> PassResult:
        return PassResult(
            [self.correct[i] for i in idx],
            [self.n_tokens[i] for i in idx],
            [self.llm_tokens[i] for i in idx],
            [self.llm_calls[i] for i in idx],
            [self.bytes_moved[i] for i in idx],
            self.wall_seconds,
            self.gpu_seconds,
            [self.tokens[i] for i in idx] if self.tokens else [],
            [self.batch_bytes[i] for i in idx] if self.batch_bytes else [],
            [self.rolled_back[i] for i in idx] if self.rolled_back else [],
            [self.counts[i] for i in idx] if self.counts else [],
            [self.priced_bytes[i] for i in idx] if self.priced_bytes else [],
        )

    def price(
        self,
        counts: Sequence[CallCounts],
        shape: RouterShape,
        router_bytes: int,
        measured: Pricing,
        reference: Pricing | None,
        what: str,
    ) -> PassResult:
        """Record each question's calls, checked against the measured bytes (priced at the pair that ran with the
        measured ``router_bytes`` they give them back exactly), and their price at ``reference``."""
        check_measured(counts, self.bytes_moved, measured, router_bytes, what)
        self.counts = list(counts)
        self.priced_bytes = reference.price_all(counts, shape) if reference is not None else []
        return self


def encode_prompts(tokenizer: Any, rows: Sequence[Mapping[str, Any]], fmt: Format) -> list[list[int]]:
    """The prompt ids every method decodes from (no special tokens, as in training)."""
    out = []
    for i, row in enumerate(rows):
        try:
            ids = tokenizer.encode(build_prompt(row, fmt), add_special_tokens=False)
        except KeyError as exc:
            raise SweepError(f"{origin(row, i)}: field {exc.args[0]!r} missing for format {fmt!r}") from exc
        if not ids:
            raise SweepError(f"{origin(row, i)}: field prompt encodes to no tokens")
        out.append(list(ids))
    return out


def examples_hash(prompts: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]]) -> str:
    """Identifies the examples a row was measured on (prompts and references)."""
    h = hashlib.sha256()
    h.update(json.dumps([list(p) for p in prompts]).encode())
    h.update(json.dumps([dict(r) for r in rows], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def grade_all(
    tokenizer: Any, tokens: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]], fmt: Format
) -> list[bool]:
    """Whether each decoded answer is right (special tokens dropped before grading)."""
    texts = [tokenizer.decode(list(t), skip_special_tokens=True) for t in tokens]
    return [bool(grade(t, r, fmt)) for t, r in zip(texts, rows, strict=True)]


def batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    # Similar lengths per batch keep left padding short; the order is fixed, so every pass sees the same batches.
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def decode_pass(
    engine: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    batch_size: int,
    max_new_tokens: int,
    solo_llm: bool = False,
    desc: str = "decode",
    bandwidth: float = GPU_BANDWIDTH["H100"],
    pricings: tuple[Pricing, Pricing | None] | None = None,
) -> PassResult:
    """Decode every prompt greedily through ``engine`` and grade it; time counts decoding only.

    ``solo_llm``: the engine is ``RoutedEngine(llm, None, AlwaysSLM())`` (plain LLM decoding, metered alike).
    Bytes are priced as if each question were decoded alone (``RowStats.bytes_alone``: exact, a row's output does not
    depend on its batch); the batch's share goes to ``batch_bytes``. ``desc`` labels the progress bar. Each
    question's calls go to ``counts``; with ``pricings`` (the pair that ran, the reference pair or None) they are
    checked against the bytes and priced at the reference (:meth:`PassResult.price`).
    """
    n = len(prompts)
    res_tokens: list[list[int]] = [[] for _ in range(n)]
    llm_tokens, llm_calls, byts, shared, rolled = [0] * n, [0] * n, [0.0] * n, [0.0] * n, [0] * n
    counts = [CallCounts()] * n
    reads_router = getattr(engine, "router_bytes", 0) > 0
    wall = 0.0
    todo = batches(prompts, batch_size)
    for idx in progress(todo, desc=desc, total=len(todo), unit="batch"):
        t0 = time.perf_counter()
        # row_ids = example indices: the random router's draws then do not depend on how rows are batched.
        res = engine.generate_batch(
            [list(prompts[i]) for i in idx], max_new_tokens=max_new_tokens, temperature=0.0, row_ids=idx
        )
        wall += time.perf_counter() - t0
        for i, toks, st in zip(idx, res.tokens, res.rows, strict=True):
            res_tokens[i] = list(toks)
            # A solo LLM engine runs the LLM in the SLM seat: every token and call is the LLM's.
            llm_tokens[i] = len(toks) if solo_llm else int(st.llm_tokens)
            llm_calls[i] = int(st.slm_calls) if solo_llm else int(st.llm_calls)
            byts[i] = float(st.bytes_alone)
            shared[i] = float(st.bytes_moved)
            rolled[i] = int(st.rolled_back_tokens)
            counts[i] = CallCounts.of_row(st, solo_llm, reads_router)
    correct = grade_all(tokenizer, res_tokens, rows, fmt)
    res = PassResult(
        correct,
        [len(t) for t in res_tokens],
        llm_tokens,
        llm_calls,
        byts,
        wall,
        sum(byts) / bandwidth,
        res_tokens,
        shared,
        rolled,
        counts,
    )
    if pricings is None:
        return res
    router = getattr(engine, "router", None)
    return res.price(counts, router_shape(router), int(getattr(engine, "router_bytes", 0)), *pricings, desc)


def _batch_columns(res: PassResult, ref: PassResult) -> dict[str, float]:
    """The batch-shared regime in its own clearly named columns (absent when the pass has no batch figures)."""
    if not res.batch_bytes or not ref.batch_bytes or sum(ref.batch_bytes) <= 0:
        return {}
    return {
        "bytes_moved_batch": float(sum(res.batch_bytes)),
        "bytes_moved_batch_rel_llm": float(sum(res.batch_bytes) / sum(ref.batch_bytes)),
    }


def to_row(
    method: str, tau: float | None, res: PassResult, llm_ref: PassResult | None, ex_hash: str, **extra: Any
) -> SweepRow:
    """Aggregate a pass into a :class:`SweepRow` (``llm_ref`` None: this pass is the LLM-only reference)."""
    ref = llm_ref or res
    n_tok = sum(res.n_tokens)
    b = sum(res.bytes_moved)
    b_ref = sum(ref.bytes_moved)
    priced = sum(res.priced_bytes) if res.priced_bytes and ref.priced_bytes else None
    priced_ref = sum(ref.priced_bytes) if priced is not None else 0.0
    return SweepRow(
        method=method,
        tau=None if tau is None else float(tau),
        accuracy=sum(res.correct) / len(res.correct),
        llm_token_fraction=sum(res.llm_tokens) / n_tok if n_tok else 0.0,
        llm_calls=int(sum(res.llm_calls)),
        bytes_moved=float(b),
        bytes_moved_rel_llm=b / b_ref if b_ref > 0 else float("nan"),
        sec_per_token=res.wall_seconds / n_tok if n_tok else float("nan"),
        gpu_sec_per_token=res.gpu_seconds / n_tok if n_tok else None,
        n_examples=len(res.correct),
        n_tokens=int(n_tok),
        llm_accuracy=sum(ref.correct) / len(ref.correct),
        examples_hash=ex_hash,
        extra=dict(extra) | _batch_columns(res, ref),
        correct=[bool(c) for c in res.correct],
        question_bytes=[float(b) for b in res.bytes_moved],
        bytes_priced=priced,
        bytes_priced_rel_llm=None if priced is None or priced_ref <= 0 else priced / priced_ref,
        question_bytes_priced=[float(b) for b in res.priced_bytes] if priced is not None else [],
    )


def speculative_result(
    outputs: Sequence[SpeculativeOutput],
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    gpu: str,
    weight_share: int = 1,
) -> tuple[PassResult, dict[str, float]]:
    """A pass from per-question assisted-generation outputs (:func:`citer.decoding.speculative.speculative_generate`),
    graded like every other pass.

    ``llm_tokens`` counts the tokens the LLM wrote itself: each verification call emits exactly one token of its own
    (a correction or the bonus token) besides the accepted drafts.

    Bytes are measured at batch 1 (assisted generation runs one question at a time), the regime of every method's
    ``bytes_moved``. ``batch_bytes`` estimates a batched speculative decoder by dividing each call's weight read by
    ``weight_share`` (the sweep's batch size; optimistic, rows leave a real batch as they finish). The second return
    value holds the measured totals (``slm_calls``, ``llm_calls``, ``new_tokens``).
    """
    n = len(outputs)
    res = PassResult(
        [False] * n, [0] * n, [0] * n, [0] * n, [0.0] * n, 0.0, 0.0, [[] for _ in range(n)], [0.0] * n
    )
    totals = {"slm_calls": 0.0, "llm_calls": 0.0, "new_tokens": 0.0}
    for i, o in enumerate(outputs):
        totals["slm_calls"] += o.slm_calls
        totals["llm_calls"] += o.llm_calls
        totals["new_tokens"] += len(o.tokens)
        res.tokens[i] = list(o.tokens)
        res.n_tokens[i] = len(o.tokens)
        res.llm_calls[i] = o.llm_calls
        res.llm_tokens[i] = min(o.llm_calls, len(o.tokens))
        res.bytes_moved[i] = float(o.bytes_moved)
        res.batch_bytes[i] = float(o.bytes_moved - o.weight_bytes * (1.0 - 1.0 / weight_share))
        res.wall_seconds += o.wall_seconds
        res.gpu_seconds += o.bytes_moved / GPU_BANDWIDTH[gpu]
    res.correct = grade_all(tokenizer, res.tokens, rows, fmt)
    return res, totals


def speculative_row(
    sp: PassResult,
    llm_res: PassResult,
    idx: list[int],
    ex_hash: str,
    secs: float,
    totals: Mapping[str, float],
) -> SweepRow:
    """The speculative row, measured and graded on the examples ``idx``. On a subset (``sweep.speculative_examples``)
    its bytes are relative to LLM-only on that subset, nothing is extrapolated, and it carries no per-question
    vectors (it cannot be paired with the other rows): ``extra.n_measured`` says so."""
    llm_sub = llm_res.subset(idx)
    agree = sum(a == b for a, b in zip(sp.tokens, llm_sub.tokens, strict=True)) / len(idx)
    row = to_row(
        "speculative",
        None,
        sp,
        llm_sub,
        ex_hash,
        n_measured=len(idx),
        llm_agreement=agree,
        pass_seconds=secs,
        **totals,
    )
    if len(idx) != len(llm_res.correct):
        row.correct, row.question_bytes = [], []
        row.extra["subset_only"] = True
    return row
