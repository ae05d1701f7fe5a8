"""Tokens chosen from a batch of next-token logits whose rows may each sample differently, their log-probs, and the
step's one read back to the host (the routing rule itself: :mod:`citer.decoding.decide`).

Shapes: k = rows, V = the model's (possibly padded) vocabulary; logits are cut to the shared vocabulary first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from citer.decoding.decide import Sampling
from citer.decoding.pairing import cut_logits
from citer.decoding.sampling import select_tokens

TopLogprobs = tuple[
    float, list[tuple[int, float]]
]  # the chosen token's log-prob, the k likeliest (token, log-prob)


_PINNED: dict[tuple[torch.device, tuple[int, ...], torch.dtype], torch.Tensor] = {}


def read_to_host(t: torch.Tensor) -> list:
    """The step's one device -> host read, as nested Python lists: on CUDA through a page-locked buffer kept per
    (device, shape, dtype) (an async copy and one wait on the stream, not a copy through pageable memory); elsewhere
    ``tolist``."""
    if not t.is_cuda:
        return t.tolist()
    key = (t.device, tuple(t.shape), t.dtype)
    buf = _PINNED.get(key)
    if buf is None:
        buf = _PINNED[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return buf.tolist()


def choose_token_tensor(
    logits: torch.Tensor,
    sampling: Sequence[Sampling],
    rid: torch.Tensor,
    steps: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Tokens (k,) long on the logits' device for the k rows of ``logits`` (k, V), one sampler call per distinct
    sampling setting and no host read, so a caller reads them with whatever else the step needs; ``rid``/``steps``
    (k,) key each row's draw, so a row's token depends only on its own id and step."""
    logits = cut_logits(logits, vocab_size)
    groups: dict[Sampling, list[int]] = {}
    for i, s in enumerate(sampling):
        groups.setdefault(s, []).append(i)
    if len(groups) == 1:
        ((t, p, seed),) = groups
        return select_tokens(logits, t, p, seed, rid, steps)
    out = torch.empty(len(sampling), dtype=torch.long, device=logits.device)
    for (t, p, seed), idx in groups.items():
        sel = torch.tensor(idx, dtype=torch.long)
        sel_dev = sel.to(logits.device)
        out[sel_dev] = select_tokens(logits[sel_dev], t, p, seed, rid[sel], steps[sel])
    return out


def token_logprobs(
    logits: torch.Tensor, toks: Sequence[int], top_k: Sequence[int | None], vocab_size: int
) -> list[TopLogprobs | None]:
    """For each row i with ``top_k[i]`` not None: the log-prob of ``toks[i]`` under ``logits[i]`` (temperature 1,
    shared vocabulary) and its ``top_k[i]`` likeliest tokens; None for the other rows."""
    want = [i for i, k in enumerate(top_k) if k is not None]
    out: list[TopLogprobs | None] = [None] * len(toks)
    if not want:
        return out
    sel = torch.tensor(want, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(cut_logits(logits.index_select(0, sel), vocab_size).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([toks[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
    k = max(top_k[i] or 0 for i in want)
    top_v, top_i = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (None, None)
    for j, i in enumerate(want):
        kk = top_k[i] or 0
        top = (
            list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist(), strict=True))
            if top_i is not None and top_v is not None and kk
            else []
        )
        out[i] = (chosen[j], top)
    return out
