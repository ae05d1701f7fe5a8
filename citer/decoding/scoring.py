"""The routed policy's teacher-forced score of a text: how likely the routed decoder finds each token of it.

At every scored position the router reads the SLM's hidden state there, exactly as it would while decoding, and the
model it picks (the SLM at or above tau, else the LLM) gives the log-probability of the text's next token. So a
multiple-choice question can be graded by the likelihood of each choice under the same decisions that generation
would make, without generating: the loglikelihood tasks of evaluation harnesses (ARC, MMLU) run through the router.

Cost: one SLM pass over every text of a call, then at most one LLM pass, over only the texts some position of which
the router sends to the LLM, each cut after its last such position. Log-probabilities are of the models' own
distributions (temperature 1, no top-p), over the shared vocabulary (:func:`~citer.decoding.pairing.cut_logits`).
Shapes: n = scored positions in a call, V = vocab, H = SLM hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from citer.decoding.pairing import cut_logits
from citer.decoding.session import EngineInputError


@dataclass
class TokenScores:
    """Per scored token of one text: its log-probability, whether it was the argmax of the distribution that scored
    it, whether that distribution was the LLM's, and (``top_k`` > 0) the ``top_k`` likeliest ``(token, logprob)``."""

    logprobs: list[float]
    is_greedy: list[bool]
    from_llm: list[bool]
    top: list[list[tuple[int, float]]] | None = None

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))

    @property
    def greedy(self) -> bool:
        return all(self.is_greedy)


def _score_with(
    logits: torch.Tensor, targets: list[int], vocab: int, top_k: int
) -> tuple[list[float], list[bool], list[list[tuple[int, float]]] | None]:
    lp = torch.log_softmax(cut_logits(logits, vocab).float(), dim=-1)  # (n, V)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])[:, 0]
    greedy = lp.argmax(dim=-1) == tgt
    top = None
    if top_k > 0:
        v, i = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        top = [list(zip(r_i, r_v, strict=True)) for r_i, r_v in zip(i.tolist(), v.tolist(), strict=True)]
    return chosen.tolist(), greedy.tolist(), top


@torch.inference_mode()
def routed_loglikelihood_batch(
    engine: Any,
    items: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    top_k: int = 0,
    row_ids: Sequence[int] | None = None,
) -> list[TokenScores]:
    """:func:`routed_loglikelihood` for several ``(prompt_ids, continuation_ids)`` pairs: one SLM pass over all of
    them and at most one LLM pass. ``row_ids`` (default 0..n-1) key a random router, as in generation."""
    if top_k < 0:
        raise EngineInputError(f"top_k must be >= 0, got {top_k}")
    seqs: list[list[int]] = []
    for i, (prompt, cont) in enumerate(items):
        if len(prompt) == 0:
            raise EngineInputError(f"items[{i}]: empty prompt (the first token has no score)")
        if len(cont) == 0:
            raise EngineInputError(f"items[{i}]: empty continuation, nothing to score")
        seqs.append([int(t) for t in prompt] + [int(t) for t in cont])
    if not seqs:
        return []
    # The whole text must fit the context, as a decode of the continuation would need.
    engine.check_prompts([s[:-1] for s in seqs], 1, None)
    ids = list(range(len(seqs))) if row_ids is None else [int(r) for r in row_ids]
    # Position p predicts token p + 1; a text of prompt length P scores tokens P.. with states P-1..
    rows = [r for r, (p, c) in enumerate(items) for _ in range(len(c))]
    pos = [len(p) - 1 + k for p, c in items for k in range(len(c))]
    steps = [
        k for _, c in items for k in range(len(c))
    ]  # the step at which generation would choose the token
    targets = [seqs[r][q + 1] for r, q in zip(rows, pos, strict=True)]
    slm_logits, hidden = engine.positions("slm", seqs, rows, pos)
    to_llm = engine.route(
        hidden, torch.tensor([ids[r] for r in rows], dtype=torch.long), torch.tensor(steps, dtype=torch.long)
    ).cpu()
    lp, greedy, top = _score_with(slm_logits, targets, engine.vocab_size, top_k)
    if bool(to_llm.any()):
        if engine.llm is None:
            raise ValueError("router sent a token to the LLM but the engine has llm=None")
        at = to_llm.nonzero()[:, 0].tolist()
        need = sorted({rows[i] for i in at})
        local = {r: j for j, r in enumerate(need)}
        last = {r: max(pos[i] for i in at if rows[i] == r) for r in need}
        llm_logits, _ = engine.positions(
            "llm", [seqs[r][: last[r] + 1] for r in need], [local[rows[i]] for i in at], [pos[i] for i in at]
        )
        l_lp, l_greedy, l_top = _score_with(llm_logits, [targets[i] for i in at], engine.vocab_size, top_k)
        for j, i in enumerate(at):
            lp[i], greedy[i] = l_lp[j], l_greedy[j]
            if top is not None and l_top is not None:
                top[i] = l_top[j]
    flags = to_llm.tolist()
    out, start = [], 0
    for _, c in items:
        end = start + len(c)
        out.append(
            TokenScores(
                lp[start:end], greedy[start:end], flags[start:end], None if top is None else top[start:end]
            )
        )
        start = end
    return out


def routed_loglikelihood(
    engine: Any,
    prompt_ids: Sequence[int],
    continuation_ids: Sequence[int],
    *,
    top_k: int = 0,
    row_id: int = 0,
) -> TokenScores:
    """The routed policy's log-probability of each token of ``continuation_ids`` after ``prompt_ids``: at each
    position the router decides, on the SLM's hidden state, whose distribution scores the next token (see the module
    docstring). ``sum(result.logprobs)`` is the continuation's log-likelihood; ``result.greedy`` says whether greedy
    routed decoding would have written it."""
    return routed_loglikelihood_batch(
        engine, [(prompt_ids, continuation_ids)], top_k=top_k, row_ids=[row_id]
    )[0]
