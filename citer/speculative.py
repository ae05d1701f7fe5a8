"""Speculative decoding as a sweep baseline: transformers' assisted generation, metered like the routed engine.

``llm.generate(assistant_model=slm)`` is lossless under greedy decoding (its output is the LLM's), so what it adds to
the comparison is cost: every forward call of either model is caught by a pre-hook and charged through
:class:`citer.cost.CostMeter` exactly as the engine charges its own calls. Assisted generation takes batch size 1.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from citer.data.prompts import Format
from citer.pareto import SweepRow
from citer.sweep import PassResult, grade_all, to_row


@torch.no_grad()
def speculative_pass(
    slm: Any,
    llm: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    max_new_tokens: int,
    draft_tokens: int,
    gpu: str,
    weight_share: int = 1,
) -> tuple[PassResult, dict[str, float]]:
    """``llm.generate(assistant_model=slm)`` per question (batch size 1, greedy: lossless w.r.t. the LLM).

    Every forward call of either model is caught by a pre-hook and metered like the engine's calls (rows fed, cache
    columns attended). ``llm_tokens`` counts the tokens the LLM wrote itself: each verification call emits exactly
    one token of its own (a correction or the bonus token) besides the accepted drafts.

    Bytes: the engine shares each call's weight read among the rows of its batch; assisted generation runs one
    question at a time, so to compare like with like the weight bytes of every call are divided by
    ``weight_share`` (the sweep passes its batch size: the estimate of a batched speculative decoder, optimistic
    because rows leave a real batch as they finish). KV bytes are per question and exact. The second return value
    holds the measured batch-1 totals (``bytes_batch1``, ``slm_calls``, ``llm_calls``, ``new_tokens``).
    """
    from transformers.utils import logging as hf_logging

    from citer.cost import GPU_BANDWIDTH, CostMeter, ModelCost

    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    dev = next(llm.parameters()).device
    costs = (ModelCost.from_model(slm), ModelCost.from_model(llm))
    n = len(prompts)
    out = PassResult([False] * n, [0] * n, [0] * n, [0] * n, [0.0] * n, 0.0, 0.0, [[] for _ in range(n)])
    meter: list[CostMeter] = []
    totals = {"bytes_batch1": 0.0, "slm_calls": 0.0, "llm_calls": 0.0, "new_tokens": 0.0}

    def hook(key: str):
        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = kwargs.get("past_key_values")
            new = int(ids.shape[1])
            seen = int(past.get_seq_length()) if past is not None else 0
            meter[0].forward(key, [0], [new], [seen + new])  # type: ignore[arg-type]

        return pre

    gen_cfg = slm.generation_config
    draft_cfg = copy.deepcopy(gen_cfg)
    # A constant draft length and no adaptive confidence cut keep runs reproducible (the defaults adapt across calls).
    draft_cfg.num_assistant_tokens = draft_tokens
    draft_cfg.num_assistant_tokens_schedule = "constant"
    draft_cfg.assistant_confidence_threshold = 0.0
    handles = [
        slm.register_forward_pre_hook(hook("slm"), with_kwargs=True),
        llm.register_forward_pre_hook(hook("llm"), with_kwargs=True),
    ]
    slm.generation_config = draft_cfg
    verbosity = hf_logging.get_verbosity()
    # Assisted generation warns on every call about its internal generation_config; once is plenty.
    hf_logging.set_verbosity_error()
    try:
        for i, p in enumerate(prompts):
            meter[:] = [CostMeter(costs[0], costs[1], 1, gpu)]
            ids = torch.tensor([list(p)], dtype=torch.long, device=dev)  # (1, T)
            t0 = time.perf_counter()
            gen = llm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=slm,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            out.wall_seconds += time.perf_counter() - t0
            toks = gen[0, ids.shape[1] :].tolist()
            toks = toks[: toks.index(eos) + 1] if eos in toks else toks
            stats, batch = meter[0].finish(0.0)
            calls = int(batch.llm_calls)
            weights = batch.slm_calls * costs[0].weight_bytes + calls * costs[1].weight_bytes
            shared = float(stats[0].bytes_moved) - weights * (1.0 - 1.0 / weight_share)
            totals["bytes_batch1"] += float(stats[0].bytes_moved)
            totals["slm_calls"] += batch.slm_calls
            totals["llm_calls"] += calls
            totals["new_tokens"] += len(toks)
            out.tokens[i] = toks
            out.n_tokens[i] = len(toks)
            out.llm_calls[i] = calls
            out.llm_tokens[i] = min(calls, len(toks))
            out.bytes_moved[i] = shared
            out.gpu_seconds += shared / GPU_BANDWIDTH[gpu]
    finally:
        hf_logging.set_verbosity(verbosity)
        slm.generation_config = gen_cfg
        for h in handles:
            h.remove()
    out.correct = grade_all(tokenizer, out.tokens, rows, fmt)
    return out, totals


def speculative_row(
    sp: PassResult,
    llm_res: PassResult,
    idx: list[int],
    ex_hash: str,
    secs: float,
    totals: Mapping[str, float],
) -> SweepRow:
    """The speculative row; on a subset of the examples its bytes and calls are scaled to the whole set by the
    LLM-only pass's bytes on that subset, and its accuracy is LLM-only's (greedy assisted generation is lossless;
    the measured agreement with the LLM-only outputs is in ``extra``)."""
    llm_sub = llm_res.subset(idx)
    agree = sum(a == b for a, b in zip(sp.tokens, llm_sub.tokens, strict=True)) / len(idx)
    measured = sum(sp.correct) / len(idx)
    row = to_row(
        "speculative",
        None,
        sp,
        llm_sub,
        ex_hash,
        n_measured=len(idx),
        measured_accuracy=measured,
        llm_agreement=agree,
        pass_seconds=secs,
        **{f"batch1_{k}": v for k, v in totals.items()},
    )
    if len(idx) == len(llm_res.correct):
        return row
    scale = sum(llm_res.bytes_moved) / sum(llm_sub.bytes_moved)
    row.accuracy = sum(llm_res.correct) / len(llm_res.correct)
    row.llm_accuracy = row.accuracy
    row.bytes_moved *= scale
    row.llm_calls = round(row.llm_calls * scale)
    row.n_examples = len(llm_res.correct)
    row.extra["scaled_from_subset"] = scale
    return row
