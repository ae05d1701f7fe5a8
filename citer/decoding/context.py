"""One forward call over a KV pool, laid out: :func:`prepare` builds its :class:`CallInput` for decode steps, padded
catch-ups, packed catch-ups and catch-ups as a decode step of their tokens alike.

A call feeds ``chunks[i]`` to pool slot ``slots[i]``. Padded, the chunks are right-padded to the longest (Q): pad
queries repeat the row's last real position and write their keys to the pool's trash column, so they see exactly the
row's valid columns and change nothing. Packed, every new token sits in one sequence (1, N): the linears run over N
tokens, not b x Q. A held row (an empty chunk) rides along in a padded call without writing. The mask lets each query
see only its own row's valid, causal columns, so batching cannot change a logit beyond float rounding.
Shapes: b = rows in the call, Q = longest chunk, N = tokens fed, K = key columns attended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from citer.decoding.kv_pool import KVPool, PoolCall


@dataclass
class CallInput:
    """A prepared call: ids and positions (b, Q) or, packed, (1, N); the mask (None: every row attends all K
    columns); the positions' bound ``n_pos``; ``last``, where each row's output is read (a (b,) index, or packed a
    (batch_idx, pos_idx) pair); packed, ``pick_all`` reads every fed token and ``scatter`` = (tok_row (N,), tok_j (N,),
    b, Q) lays them out per row again."""

    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor | None
    n_pos: int
    last: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    call: PoolCall
    pick_all: tuple[torch.Tensor, torch.Tensor] | None = None
    scatter: tuple[torch.Tensor, torch.Tensor, int, int] | None = None


def mask_as(allowed: torch.Tensor, float_dtype: torch.dtype | None) -> torch.Tensor:
    """allowed (..., K) bool, True = attend: as it is (the lean forward, sdpa), or additive in ``float_dtype`` (HF's
    eager attention)."""
    if float_dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=float_dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(float_dtype).min
    )


def prepare(
    pool: KVPool,
    chunks: Sequence[Sequence[int]],
    slots: list[int],
    packed: bool,
    *,
    lean: bool,
    float_mask: torch.dtype | None = None,
    in_place: bool = False,
    tokens: bool = False,
) -> CallInput:
    """Lay out one call feeding ``chunks[i]`` to ``slots[i]`` (module docstring): a decode step (every chunk one token
    or empty), a padded call, or (``packed``) a packed one. ``lean``: the lean forward runs it (it attends a packed
    call per row, and a step whose rows all sit at the last column without a mask); ``float_mask``: the additive
    mask's dtype where HF's eager attention runs it; ``in_place``: named slots are attended where they lie, a run of
    consecutive slots at a time (``PoolCall.runs``; the eager lean forward), not gathered; ``tokens``: the call as
    a decode step of its tokens (:func:`_tokens`)."""
    gaps = [len(c) for c in chunks]
    if tokens:
        return _tokens(pool, chunks, slots, gaps, float_mask)
    if packed:
        inp = _packed(pool, chunks, slots, gaps, lean, float_mask)
        if lean and in_place:
            inp.call.runs = slot_runs(slots)
        return inp
    dev = pool.device
    b = len(chunks)
    kv_len = int(max(pool.lengths[s] + n for s, n in zip(slots, gaps, strict=True)))
    prefix = slots == list(range(b))
    named = None if prefix else torch.tensor(slots, dtype=torch.long, device=dev)  # (b,)
    call = PoolCall(
        kv_len,
        rows=torch.arange(b, device=dev)[:, None] if named is None else named[:, None],  # (b, 1)
        slots=named,
        runs=slot_runs(slots) if lean and in_place and not prefix else None,
    )
    if max(gaps) == 1:
        return _step(pool, chunks, slots, call, lean, float_mask)
    q = max(gaps)
    ids = torch.tensor(
        [list(c) + [c[-1] if c else 0] * (q - len(c)) for c in chunks], dtype=torch.long, device=dev
    )  # (b, Q)
    starts, g, j, pos, mask = _row_queries(pool, slots, gaps, kv_len, float_mask)
    call.cols = torch.where(
        j < g[:, None], starts[:, None] + j, torch.full_like(pos, pool.capacity)
    )  # (b, Q)
    return CallInput(ids, pos, mask, kv_len, g - 1, call)


def slot_runs(slots: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``slots`` cut into runs of consecutive slots: (index of the run's first row in the call, its first slot, its
    rows). The rows of a run are one view of the pool, so attending a run reads its keys where they lie."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return tuple(runs)


def _row_queries(
    pool: KVPool, slots: list[int], gaps: list[int], kv_len: int, float_mask: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call's queries laid out per row, padded to the longest chunk Q, against ``kv_len`` (K) columns: starts (b,)
    each row's cached length, g (b,) its chunk length, j (1, Q), pos (b, Q) and the mask (b, 1, Q, K). Pad queries
    repeat the last real position, so they see exactly the row's valid columns (never all-masked); a held row's
    queries sit at its last cached position."""
    dev = pool.device
    starts = torch.tensor([pool.lengths[s] for s in slots], dtype=torch.long, device=dev)  # (b,)
    g = torch.tensor(gaps, dtype=torch.long, device=dev)  # (b,)
    j = torch.arange(max(gaps), device=dev)[None, :]  # (1, Q)
    pos = starts[:, None] + torch.minimum(j, g[:, None] - 1)  # (b, Q)
    allowed = torch.arange(kv_len, device=dev)[None, None, :] <= pos[:, :, None]  # (b, Q, K)
    return starts, g, j, pos, mask_as(allowed[:, None], float_mask)


def _step(
    pool: KVPool,
    chunks: Sequence[Sequence[int]],
    slots: list[int],
    call: PoolCall,
    lean: bool,
    float_mask: torch.dtype | None,
) -> CallInput:
    """The decode step: the padded call's columns, positions and mask, built from Python ints in a few tensor ops (a
    step of a small model is bound by the op count, not the math)."""
    dev = pool.device
    lens = [pool.lengths[s] for s in slots]
    # A held row (empty chunk) re-queries its last cached position and writes to the trash column.
    pos = [n if c else n - 1 for n, c in zip(lens, chunks, strict=True)]
    cols = [n if c else pool.capacity for n, c in zip(lens, chunks, strict=True)]
    # (3, b, 1): ids, positions, columns
    step = torch.tensor([[c[0] if c else 0 for c in chunks], pos, cols], dtype=torch.long, device=dev)[
        :, :, None
    ]
    call.cols = step[2]
    if lean and pos.count(call.kv_len - 1) == len(pos):
        # Every row sits at the last column (batch 1, or rows of one length): each attends all K columns, so the
        # lean forward's attention needs no mask.
        mask = None
    else:
        allowed = torch.arange(call.kv_len, device=dev) <= step[1][:, :, None]  # (b, 1, K)
        mask = mask_as(allowed[:, None], float_mask)  # (b, 1, 1, K)
    return CallInput(step[0], step[1], mask, call.kv_len, step[1][:, 0], call)


def _packed(
    pool: KVPool,
    chunks: Sequence[Sequence[int]],
    slots: list[int],
    gaps: list[int],
    lean: bool,
    float_mask: torch.dtype | None,
) -> CallInput:
    dev = pool.device
    b, q = len(chunks), max(gaps)
    tok_row, tok_j = _token_index(gaps)
    starts = [pool.lengths[s] for s in slots]
    tok_pos = [starts[i] + j for i, j in zip(tok_row, tok_j, strict=True)]
    t = {k: torch.tensor(v, dtype=torch.long, device=dev) for k, v in
         dict(tok_row=tok_row, tok_j=tok_j, tok_pos=tok_pos, slots=slots).items()}  # fmt: skip
    ids = torch.tensor([[x for c in chunks for x in c]], dtype=torch.long, device=dev)  # (1, N)
    slot_t = t["slots"][t["tok_row"]]  # (N,)
    kv_len = max(n + g for n, g in zip(starts, gaps, strict=True))
    if lean:
        # Linears over the N packed tokens, attention per row over its own columns (b, Q, K): a block-diagonal mask
        # over every row's keys (N, sum K_i) would score each token against all the rows' keys.
        call = PoolCall(kv_len, rows=slot_t[None], cols=t["tok_pos"][None], slots=t["slots"])
        call.varlen = (t["tok_row"], t["tok_j"], b, q)
        mask = _row_queries(pool, slots, gaps, kv_len, float_mask)[-1]  # (b, 1, Q, K)
    else:
        key_row = [i for i, (n, g) in enumerate(zip(starts, gaps, strict=True)) for _ in range(n + g)]
        key_col = [c for n, g in zip(starts, gaps, strict=True) for c in range(n + g)]
        k_row = torch.tensor(key_row, dtype=torch.long, device=dev)  # (sum K_i,)
        k_col = torch.tensor(key_col, dtype=torch.long, device=dev)
        call = PoolCall(kv_len, rows=slot_t[None], cols=t["tok_pos"][None], keys=(t["slots"][k_row], k_col))
        # Token n sees key k iff same row and k's column <= n's position: (N, sum K_i).
        allowed = (k_row[None, :] == t["tok_row"][:, None]) & (k_col[None, :] <= t["tok_pos"][:, None])
        mask = mask_as(allowed[None, None], float_mask)  # (1, 1, N, sum K_i)
    last, every = _read_index(gaps, dev)
    return CallInput(
        ids,
        t["tok_pos"][None],
        mask,
        int(mask.shape[-1]),
        (torch.zeros_like(last), last),
        call,
        pick_all=(torch.zeros_like(every), every),
        scatter=(t["tok_row"], t["tok_j"], b, q),
    )


def _tokens(
    pool: KVPool,
    chunks: Sequence[Sequence[int]],
    slots: list[int],
    gaps: list[int],
    float_mask: torch.dtype | None,
) -> CallInput:
    """The call as a decode step of its N tokens: each token is a row (N, 1) that writes its key to its row's slot at
    its own position and attends that slot's columns up to it. A decode step's ops write every key of a layer before
    any query reads (:func:`~citer.decoding.cpu_step.decode_layer`), so a chunk sees its own earlier tokens, and each
    token's sums run as in a one-token step; elsewhere the named slots are gathered per token (correct, not fast).
    Read like a packed call: ``last`` and ``pick_all`` index the token rows, ``scatter`` lays them out per row."""
    dev = pool.device
    b, q = len(chunks), max(gaps)
    tok_row, tok_j = _token_index(gaps)
    # (5, N): ids, positions (= the columns written), slots, rows in the call, indices within the chunks
    t = torch.tensor(
        [
            [x for c in chunks for x in c],
            [pool.lengths[slots[i]] + j for i, j in zip(tok_row, tok_j, strict=True)],
            [slots[i] for i in tok_row],
            tok_row,
            tok_j,
        ],
        dtype=torch.long,
        device=dev,
    )
    kv_len = int(max(pool.lengths[s] + n for s, n in zip(slots, gaps, strict=True)))
    allowed = torch.arange(kv_len, device=dev) <= t[1][:, None, None]  # (N, 1, K)
    call = PoolCall(kv_len, rows=t[2][:, None], cols=t[1][:, None], slots=t[2])
    last, every = _read_index(gaps, dev)
    return CallInput(
        t[0][:, None],
        t[1][:, None],
        mask_as(allowed[:, None], float_mask),
        kv_len,
        (last, torch.zeros_like(last)),
        call,
        pick_all=(every, torch.zeros_like(every)),
        scatter=(t[3], t[4], b, q),
    )


def _token_index(gaps: list[int]) -> tuple[list[int], list[int]]:
    """Each fed token's row in the call and its index within that row's chunk: (N,) and (N,)."""
    return [i for i, n in enumerate(gaps) for _ in range(n)], [j for n in gaps for j in range(n)]


def _read_index(gaps: list[int], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a call of fed tokens is read: each row's last token (b,) (a held row's is meaningless) and every token
    (N,), as indices into the N tokens."""
    return torch.tensor(gaps, device=dev).cumsum(0) - 1, torch.arange(sum(gaps), device=dev)
