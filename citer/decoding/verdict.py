"""What a verified LLM call decides for each row it checked (:mod:`citer.decoding.verify`'s rule): the positions it
checks (:func:`candidates`) and, from the LLM's logits there, each row's :class:`Verdict` (:func:`verdicts`).

Shapes: N = candidate positions in the call, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from citer.decoding.choice import TopLogprobs, choose_token_tensor, token_logprobs
from citer.decoding.pairing import cut_logits
from citer.decoding.rows import Row
from citer.decoding.verify import first_cuts


@dataclass(frozen=True)
class Verdict:
    """What an LLM call decides for a row it checked: the token the row emits, whether the LLM wrote it, its log-probs
    (where the row asked for them), and ``cut``, the seq index from which the row's provisional tokens are taken back
    (None: none are)."""

    token: int
    from_llm: bool
    logprob: TopLogprobs | None
    cut: int | None


def candidates(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """The positions an LLM call checks, each row's contiguous and in order: (the row's index in ``rows``, a seq index
    ``t``) for every unverified token and the token after them; the LLM predicts seq index ``t`` after ``t - 1``."""
    return [(i, t) for i, r in enumerate(rows) for t in range(r.verified, len(r.seq) + 1)]


def verdicts(
    rows: Sequence[Row], cands: list[tuple[int, int]], flat: torch.Tensor, vocab_size: int, rho: float
) -> list[Verdict]:
    """Each row's :class:`Verdict` from the LLM's logits ``flat`` (N, V) at its :func:`candidates` ``cands``: the row is
    cut at its first rejected candidate (:func:`~citer.decoding.verify.first_cuts`), where the LLM's own choice (drawn with the key the row
    would have used at that step) replaces it; a row whose every candidate passes keeps its check call's SLM
    proposal. A forced row's last position is always the LLM's."""
    owner = [i for i, _ in cands]
    step_of = [t - rows[i].prompt_len for i, t in cands]
    proposed = [
        rows[i].seq[t] if t < len(rows[i].seq) else -1 if rows[i].check is None else rows[i].check
        for i, t in cands
    ]
    rid = torch.tensor([rows[i].row_id for i in owner], dtype=torch.long)
    choice = choose_token_tensor(
        flat, [rows[i].sampling for i in owner], rid, torch.tensor(step_of), vocab_size
    ).tolist()
    logp = torch.log_softmax(cut_logits(flat, vocab_size).float(), dim=-1)  # (N, V)
    out = []
    for r, n in zip(rows, first_cuts(logp, proposed, choice, owner, rho, len(rows)), strict=True):
        if n < 0:  # every token passed, the check's proposal included: the SLM's token stands
            assert r.check is not None
            out.append(Verdict(r.check, False, r.check_lp, None))
        else:
            lp = token_logprobs(flat[n : n + 1], [choice[n]], [r.logprobs], vocab_size)[0]
            t = step_of[n] + r.prompt_len
            out.append(Verdict(choice[n], True, lp, t if t < len(r.seq) else None))
    return out
