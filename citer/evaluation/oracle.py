"""The lossless oracle: how few tokens the LLM must write for routed decoding to return the LLM's own answers.

Teacher-force the SLM over the LLM's greedy answer: wherever the SLM's greedy token differs from the LLM's, the LLM
must write; everywhere else the SLM writes the same token. Replaying those decisions through the routed engine
(:class:`OracleRouter`, keyed by row and step) reproduces the LLM's answers token for token while pricing every call
exactly like every other method. No router can send fewer tokens to the LLM and keep every LLM answer, so CITER's
bytes over the oracle's say how much room the router leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from citer.decoding.padding import right_padded
from citer.decoding.pairing import cut_logits
from citer.evaluation.passes import batches
from citer.evaluation.thresholds import answer_positions


@torch.no_grad()
def oracle_flags(
    slm: Any,
    prompts: Sequence[Sequence[int]],
    llm_outputs: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
    vocab_size: int,
    engine: Any | None = None,
) -> list[list[bool]]:
    """Per example, per token of the LLM's answer: True where the SLM's greedy token (given the LLM's prefix)
    differs, i.e. where the LLM must write it. The SLM is ``engine``'s where given (``engine.positions``: the
    runner that replays the flags, whose greedy tokens may differ from the torch ``slm``'s), else ``slm``. llama.cpp's
    logits are not bit-identical between this whole-text pass and step-by-step decoding, so at a near-tie a replay
    may still leave the LLM's answer; the oracle row's accuracy says so."""
    if engine is not None:
        return _flags_on(engine, prompts, llm_outputs, batch_size, vocab_size)
    dev = next(slm.parameters()).device
    out: list[list[bool]] = [[] for _ in prompts]
    for idx in batches(prompts, batch_size):
        seqs = [list(prompts[i]) + list(llm_outputs[i]) for i in idx]
        ids, mask = right_padded(seqs, pad_id)  # (B, T)
        logits = slm(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits  # (B, T, V)
        greedy = cut_logits(logits, vocab_size).argmax(-1).cpu()  # (B, T)
        for r, i in enumerate(idx):
            start, n = len(prompts[i]) - 1, len(llm_outputs[i])
            slm_tok = greedy[r, start : start + n].tolist()
            out[i] = [a != b for a, b in zip(slm_tok, llm_outputs[i], strict=True)]
    return out


def _flags_on(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    llm_outputs: Sequence[Sequence[int]],
    batch_size: int,
    vocab_size: int,
) -> list[list[bool]]:
    out: list[list[bool]] = [[] for _ in prompts]
    for idx in batches(prompts, batch_size):
        seqs, rows, pos = answer_positions(prompts, llm_outputs, idx)
        if not rows:
            continue
        logits, _ = engine.positions("slm", seqs, rows, pos)  # (n, V)
        greedy = cut_logits(logits, vocab_size).argmax(-1).tolist()  # (n,)
        at = 0
        for i in idx:
            n = len(llm_outputs[i])
            out[i] = [a != b for a, b in zip(greedy[at : at + n], llm_outputs[i], strict=True)]
            at += n
    return out


class OracleRouter:
    """Score 0 (to the LLM) exactly at the flagged (row, step) positions, 1 elsewhere. Reads no weights."""

    weight_bytes = 0

    def __init__(self, flags: Sequence[Sequence[bool]]) -> None:
        self.flags = [list(f) for f in flags]

    def __call__(
        self, hidden: torch.Tensor, row_ids: torch.Tensor | None = None, steps: torch.Tensor | None = None
    ) -> torch.Tensor:
        if row_ids is None or steps is None:
            raise ValueError("OracleRouter needs row_ids and steps (the engine passes them)")
        out = torch.ones(hidden.shape[0], dtype=torch.float32)
        for j, (r, t) in enumerate(zip(row_ids.tolist(), steps.tolist(), strict=True)):
            f = self.flags[r]
            if t < len(f) and f[t]:
                out[j] = 0.0
        return out.to(hidden.device)


def oracle_summary(flags: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """How many of the LLM's tokens the oracle sends to the LLM."""
    n = sum(len(f) for f in flags)
    k = sum(sum(f) for f in flags)
    return {"oracle_llm_tokens": int(k), "oracle_tokens": int(n), "oracle_llm_fraction": k / n if n else 0.0}
