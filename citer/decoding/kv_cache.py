"""The per-row ragged KV cache and its one-call append.

Each row has its own length, so rows whose caches lag by different gaps are appended to in one forward call, either
padded (right-padded chunk; pad keys go to a trash column) or packed (all new tokens in one sequence, when padding
would double the work; the lean forward then runs its linears over the packed tokens and its attention per row). An explicit 4D mask lets each query see only its own row's valid, causal columns, and prompts
are never padded into the cache, so batching cannot change a logit beyond float rounding.
Shapes: b = rows in a call, Q = longest chunk, K = key columns, V = vocab, H = hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from citer.decoding.forward import decoder_forward
from citer.decoding.lean import lean_decoder, runs_compiled
from citer.decoding.pairing import input_device

# What packing a call's queries costs per layer (a scatter and a gather, ~20 us on a CPU core), in the multiply-adds
# a core does meanwhile (~250 G/s, the rate of the LLM's products on the Zen 4 host in docs/results.md): an estimate
# that packs a 1.7B LLM's catch-ups at any padding and leaves small models' to the doubling rule.
PACK_COST_MACS = 5_000_000


class RaggedKVCache(Cache):
    """Per-row KV cache: per layer a (R, kv_heads, capacity + 1, head_dim) buffer; row r holds ``lengths[r]`` columns.

    A call either pads (rows x longest chunk; pad keys go to the last column, a trash slot) or packs (all new tokens
    in one sequence, each attending only its own row's columns: no padded linears; the HF forward gathers the rows'
    caches into one key sequence under a block-diagonal mask, the lean one lays the queries out per row). Rows are "slots" in buffer order;
    ``add_slots`` and ``remove_slots`` keep the active rows a prefix (the common call then uses views, not
    gathers).
    """

    compiles = True  # a compiled lean forward may trace `update` (citer.decoding.compiled)

    def __init__(
        self, model: nn.Module, n_rows: int, capacity: int, round_shapes: bool | None = None
    ) -> None:
        super().__init__(layers=[])
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._row_shape = (kv_heads, capacity + 1, head_dim)
        # Allocated by a layer's first update, on the device and in the dtype its keys arrive in: a model split by a
        # device_map keeps each layer's cache beside the layer.
        self.keys: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
        self.device = input_device(model)  # where ids, positions, masks and index tensors are built
        self.capacity = capacity
        self.lengths = [0] * n_rows  # valid columns per active slot; the active slots are 0..len-1
        self._alloc = n_rows  # slots the buffers hold (>= active)
        # Set by `append` for the duration of one forward call.
        self._slots: torch.Tensor | None = None  # (b,) slot indices, None = the prefix 0..b-1
        self._cols: torch.Tensor | None = None  # (b, Q) column each new key goes to
        self._rows: torch.Tensor | None = None  # (b, 1) the prefix slots 0..b-1, when no slots are named
        self._kv_len = 0
        # (tok_slot, tok_col) of the new tokens, and for the HF forward (key_slot, key_col) of the keys they attend
        self._packed: tuple[torch.Tensor, ...] | None = None
        # A packed call of the lean forward attends per row: (tok_row, tok_j, b, Q), read by lean.hidden.
        self.varlen: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        # Fixed-shape calls (citer.decoding.static_step.StaticSteps) for chunks of at most ``static_q`` tokens.
        self.static: Any = None
        self.static_q = 16
        self.min_rows = 1  # slots allocated at least (fixed-shape steps padded to more rows write into slots of their own)
        # Rows rounded up to a power of two and columns to a multiple of 128, so that a compiled forward sees a few
        # pool shapes and compiles its graphs for them (citer.decoding.compiled); from the next allocation on.
        # None: round where the model's forward runs compiled.
        self.round_shapes = runs_compiled(model) if round_shapes is None else round_shapes

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def reset(self) -> None:
        """Forget every row, keeping the buffers (and their addresses) for the next session."""
        self.lengths = []

    def reserve(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """Allocate (now, in ``like``'s dtype and device) room for ``rows`` slots of ``columns`` tokens."""
        self.ensure_capacity(columns)
        if rows > self._alloc:
            alloc = 1 << (rows - 1).bit_length() if self.round_shapes else rows
            self.keys = [self._grown(t, rows=alloc) for t in self.keys]
            self.values = [self._grown(t, rows=alloc) for t in self.values]
            self._alloc = alloc
        for i in range(len(self.keys)):
            self._buffers(i, like)

    def add_slots(self, k: int) -> list[int]:
        """Open ``k`` empty slots after the active ones; the pool doubles when it runs out (amortised copies)."""
        n = len(self.lengths)
        if n + k > self._alloc:
            alloc = max(n + k, 2 * self._alloc, self.min_rows)
            if self.round_shapes:
                alloc = 1 << (alloc - 1).bit_length()
            self.keys = [self._grown(t, rows=alloc) for t in self.keys]
            self.values = [self._grown(t, rows=alloc) for t in self.values]
            self._alloc = alloc
        self.lengths += [0] * k
        return list(range(n, n + k))

    def remove_slots(self, slots: Sequence[int]) -> dict[int, int]:
        """Free ``slots``; the active slots stay a prefix by moving tail rows into the holes (one row copy per hole,
        not a compaction of every row). Returns ``{old_slot: new_slot}`` for the rows that moved."""
        gone = set(slots)
        n = len(self.lengths)
        keep_n = n - len(gone)
        holes = sorted(s for s in gone if s < keep_n)
        movers = [s for s in range(keep_n, n) if s not in gone]
        moved = dict(zip(movers, holes, strict=True))
        if moved:
            src = torch.tensor(list(moved), dtype=torch.long)
            dst = torch.tensor(list(moved.values()), dtype=torch.long)
            for t in (*self.keys, *self.values):
                if t is not None:
                    t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))
            for a, b in moved.items():
                self.lengths[b] = self.lengths[a]
        del self.lengths[keep_n:]
        return moved

    def ensure_capacity(self, columns: int) -> None:
        """Grow every slot to hold ``columns`` tokens (the trash column moves to the new end)."""
        if columns <= self.capacity:
            return
        cap = max(columns, self.capacity + self.capacity // 2)
        if self.round_shapes:
            cap = -(-cap // 128) * 128
        self.keys = [self._grown(t, cols=cap) for t in self.keys]
        self.values = [self._grown(t, cols=cap) for t in self.values]
        self.capacity = cap
        self._row_shape = (self._row_shape[0], cap + 1, self._row_shape[2])

    def _grown(
        self, t: torch.Tensor | None, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor | None:
        if t is None:
            return None
        r = t.shape[0] if rows is None else rows
        c = t.shape[2] if cols is None else cols + 1
        out = torch.zeros((r, t.shape[1], c, t.shape[3]), dtype=t.dtype, device=t.device)
        keep_c = min(t.shape[2] - 1, c - 1)  # the old trash column is not carried over
        out[: t.shape[0], :, :keep_c] = t[:, :, :keep_c]
        return out

    def _buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is None:
            shape = (self._alloc, *self._row_shape)
            self.keys[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[layer_idx], self.values[layer_idx]  # type: ignore[return-value]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: (b, kv_heads, Q, head_dim) -> cache keys/values (b, kv_heads, kv_len, head_dim)
        kbuf, vbuf = self._buffers(layer_idx, key_states)
        dev = kbuf.device  # the layer's device; index tensors were built on the input device
        if self._packed is not None:
            # Packed call: key_states (1, kv_heads, N, head_dim), N new tokens of several rows in one sequence.
            tok_slot, tok_col = (t.to(dev) for t in self._packed[:2])
            kbuf[tok_slot, :, tok_col] = key_states[0].transpose(0, 1)  # (N, kv_heads, head_dim)
            vbuf[tok_slot, :, tok_col] = value_states[0].transpose(0, 1)
            if self.varlen is None:
                # Every selected row's valid columns, concatenated: (1, kv_heads, sum K_i, head_dim).
                key_slot, key_col = (t.to(dev) for t in self._packed[2:])
                return (
                    kbuf[key_slot, :, key_col].transpose(0, 1)[None],
                    vbuf[key_slot, :, key_col].transpose(0, 1)[None],
                )
            # Per-row attention (lean): the gather below, as a padded call over named slots.
        else:
            cols = self._cols if self._cols.device == dev else self._cols.to(dev)  # (b, Q)
            if self._slots is None:
                b = key_states.shape[0]
                rows = self._rows if self._rows.device == dev else self._rows.to(dev)  # (b, 1)
                kbuf[rows, :, cols] = key_states.transpose(
                    1, 2
                )  # indexed dims first: (b, Q, kv_heads, head_dim)
                vbuf[rows, :, cols] = value_states.transpose(1, 2)
                return kbuf[:b, :, : self._kv_len], vbuf[:b, :, : self._kv_len]
            rows = self._slots.to(dev)[:, None]
            kbuf[rows, :, cols] = key_states.transpose(1, 2)
            vbuf[rows, :, cols] = value_states.transpose(1, 2)
        # A gather: the selected rows' caches, cut to the longest (b, kv_heads, kv_len, head_dim).
        slots = self._slots.to(dev)
        return (
            kbuf[:, :, : self._kv_len].index_select(0, slots),
            vbuf[:, :, : self._kv_len].index_select(0, slots),
        )


def _mask_for(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    # allowed: (b, 1, Q, K) bool, True = attend. sdpa takes it as is; eager wants an additive float mask.
    # The lean check first: a config attribute read costs more than the lookup (a step reads it once).
    if lean_decoder(model) is not None or model.config._attn_implementation == "sdpa":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def ragged_append(
    model: nn.Module,
    cache: RaggedKVCache,
    chunks: Sequence[Sequence[int]],
    slots: Sequence[int] | None = None,
    packed: bool | None = None,
    every: bool = False,
    decide: tuple[Sequence[int], Sequence[int], Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Feed ``chunks[i]`` to slot ``slots[i]`` (default: slot i) in one forward call.

    An empty chunk holds its row: the row rides along (so a call over the active prefix keeps its cheap views) but
    writes nothing and its returned logits/hidden are meaningless. ``packed``: None chooses -- pack when padding would at least double the tokens computed (catch-up calls with
    mixed gaps; under a compiled forward, whenever chunks differ in length) and the packed mask stays small, pad
    otherwise (decode steps, where every chunk is one token). Returns logits (b, V) and
    hidden (b, H) at each row's last fed token. ``decide`` = (row ids, step indices, a
    :class:`~citer.decoding.step_compile.Decision`): a decode step of a model whose forward runs compiled also returns
    the next step's tokens (b,) and hard flags (b,) from the same graph (:meth:`citer.decoding.compiled.
    CompiledHidden.decided`); otherwise, or when the router cannot be traced, only the two.
    """
    dev = cache.device
    b = len(chunks)
    sl = list(range(b)) if slots is None else list(slots)
    gaps = [len(c) for c in chunks]
    q = max(gaps)
    if q == 0:
        raise ValueError("every chunk is empty: nothing to feed")
    if 0 in gaps:
        if packed:
            raise ValueError("a packed call cannot hold rows (empty chunks)")
        packed = False
    if cache.static is not None and not packed and q <= cache.static_q:
        return cache.static(cache, chunks, sl, every=every)
    if packed is None:
        # The packed mask is (N, sum K_i): keep it small, so big prefills stay padded.
        n_keys = sum(cache.lengths[s] for s in sl) + sum(gaps)
        # Eager, packing costs a scatter and a gather of the queries per layer; padding costs the pad tokens' linears:
        # pack where padding would at least double the tokens, or where the pad tokens' multiply-adds exceed what
        # the packing ops cost (a large model's catch-ups). Compiled (citer.decoding.compiled), those ops fuse away
        # and any padding is wasted matrix work.
        lean = lean_decoder(model)
        if runs_compiled(model):
            pays = sum(gaps) < b * q
        else:
            waste = (b * q - sum(gaps)) * (lean.layer_macs if lean is not None else 0)
            pays = 2 * sum(gaps) <= b * q or waste >= PACK_COST_MACS
        packed = b > 1 and pays and sum(gaps) * n_keys <= 1 << 22
    if packed:
        return _packed_append(model, cache, chunks, sl, gaps, every)
    cache._kv_len = int(max(cache.lengths[s] + n for s, n in zip(sl, gaps, strict=True)))
    cache._slots = None if sl == list(range(b)) else torch.tensor(sl, dtype=torch.long, device=dev)
    cache._rows = torch.arange(b, device=dev)[:, None] if cache._slots is None else None
    if q == 1:
        out = _step_append(model, cache, chunks, sl, None if every else decide)
        return (out[0][:, None], out[1][:, None]) if every else out
    ids = torch.tensor(
        [list(c) + [c[-1] if c else 0] * (q - len(c)) for c in chunks], dtype=torch.long, device=dev
    )  # (b, Q)
    starts, g, j, pos, mask = _row_queries(model, cache, sl, gaps)
    real = j < g[:, None]  # (b, Q)
    cache._cols = torch.where(real, starts[:, None] + j, torch.full_like(pos, cache.capacity))  # (b, Q)
    try:
        # (b, V), (b, H); every: (b, Q, V), (b, Q, H)
        logits, hidden = decoder_forward(model, ids, mask, pos, cache, last_index=None if every else g - 1)
    finally:
        cache._slots, cache._cols, cache._rows = None, None, None
    for s, n in zip(sl, gaps, strict=True):
        cache.lengths[s] += n
    return logits, hidden


def _row_queries(
    model: nn.Module, cache: RaggedKVCache, sl: list[int], gaps: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call's queries laid out per row, padded to the longest chunk Q, against ``cache._kv_len`` (K) columns:
    starts (b,) each row's cached length, g (b,) its chunk length, j (1, Q), pos (b, Q) and the mask (b, 1, Q, K).
    Pad queries repeat the last real position, so they see exactly the row's valid columns (never all-masked); a
    held row's queries sit at its last cached position."""
    dev = cache.device
    starts = torch.tensor([cache.lengths[s] for s in sl], dtype=torch.long, device=dev)  # (b,)
    g = torch.tensor(gaps, dtype=torch.long, device=dev)  # (b,)
    j = torch.arange(max(gaps), device=dev)[None, :]  # (1, Q)
    pos = starts[:, None] + torch.minimum(j, g[:, None] - 1)  # (b, Q)
    allowed = torch.arange(cache._kv_len, device=dev)[None, None, :] <= pos[:, :, None]  # (b, Q, K)
    return starts, g, j, pos, _mask_for(model, allowed[:, None])


def _step_append(
    model: nn.Module,
    cache: RaggedKVCache,
    chunks: Sequence[Sequence[int]],
    sl: list[int],
    decide: tuple[Sequence[int], Sequence[int], Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The decode step: every chunk one token or empty. The same columns, positions and mask as the padded call,
    built from Python ints in a few tensor ops (a step of a small model is bound by the op count, not the math).
    ``decide``: see :func:`ragged_append`."""
    dev = cache.device
    lens = [cache.lengths[s] for s in sl]
    # A held row (empty chunk) re-queries its last cached position and writes to the trash column.
    pos = [n if c else n - 1 for n, c in zip(lens, chunks, strict=True)]
    cols = [n if c else cache.capacity for n, c in zip(lens, chunks, strict=True)]
    # (3, b, 1): ids, positions, columns
    step = torch.tensor([[c[0] if c else 0 for c in chunks], pos, cols], dtype=torch.long, device=dev)[
        :, :, None
    ]
    cache._cols = step[2]
    if pos.count(cache._kv_len - 1) == len(pos) and lean_decoder(model) is not None:
        # Every row sits at the last column (batch 1, or rows of one length): each attends all K columns, so the
        # lean forward's attention needs no mask.
        mask = None
    else:
        allowed = torch.arange(cache._kv_len, device=dev) <= step[1][:, :, None]  # (b, 1, K)
        mask = _mask_for(model, allowed[:, None])  # (b, 1, 1, K)
    lean = lean_decoder(model) if decide is not None else None
    compiled = lean.compiled_for(cache) if lean is not None and cache._slots is None else None
    out = None
    try:
        if compiled is not None:
            assert decide is not None
            rid, steps = torch.tensor([list(decide[0]), list(decide[1])], dtype=torch.long, device=dev)
            out = compiled.decided(step[0], step[1], mask, cache, cache._kv_len, rid, steps, decide[2])
        if out is None:
            out = decoder_forward(
                model, step[0], mask, step[1], cache, last_index=step[1][:, 0], n_pos=cache._kv_len
            )
    finally:
        cache._slots, cache._cols, cache._rows = None, None, None
    for s, c in zip(sl, chunks, strict=True):
        cache.lengths[s] += len(c)
    return out


def _packed_append(
    model: nn.Module,
    cache: RaggedKVCache,
    chunks: Sequence[Sequence[int]],
    sl: list[int],
    gaps: list[int],
    every: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = cache.device
    b, q = len(chunks), max(gaps)
    tok_row = [i for i, n in enumerate(gaps) for _ in range(n)]  # (N,) each token's row in the call
    tok_j = [j for n in gaps for j in range(n)]  # (N,) its index within the row's chunk
    starts = [cache.lengths[s] for s in sl]
    tok_pos = [starts[i] + j for i, j in zip(tok_row, tok_j, strict=True)]
    t = {k: torch.tensor(v, dtype=torch.long, device=dev) for k, v in
         dict(tok_row=tok_row, tok_j=tok_j, tok_pos=tok_pos, slots=sl).items()}  # fmt: skip
    ids = torch.tensor([[x for c in chunks for x in c]], dtype=torch.long, device=dev)  # (1, N)
    slot_t = t["slots"][t["tok_row"]]  # (N,)
    if lean_decoder(model) is not None:
        # Linears over the N packed tokens, attention per row over its own columns (b, Q, K): a block-diagonal mask
        # over every row's keys (N, sum K_i) would score each token against all the rows' keys.
        cache._packed = (slot_t, t["tok_pos"])
        cache._kv_len = max(n + g for n, g in zip(starts, gaps, strict=True))
        cache._slots = t["slots"]
        cache.varlen = (t["tok_row"], t["tok_j"], b, q)
        mask = _row_queries(model, cache, sl, gaps)[-1]  # (b, 1, Q, K)
    else:
        key_row = [i for i, (n, g) in enumerate(zip(starts, gaps, strict=True)) for _ in range(n + g)]
        key_col = [c for n, g in zip(starts, gaps, strict=True) for c in range(n + g)]
        k_row = torch.tensor(key_row, dtype=torch.long, device=dev)  # (sum K_i,)
        k_col = torch.tensor(key_col, dtype=torch.long, device=dev)
        cache._packed = (slot_t, t["tok_pos"], t["slots"][k_row], k_col)
        # Token n sees key k iff same row and k's column <= n's position: (N, sum K_i).
        allowed = (k_row[None, :] == t["tok_row"][:, None]) & (k_col[None, :] <= t["tok_pos"][:, None])
        mask = _mask_for(model, allowed[None, None])  # (1, 1, N, sum K_i)
    last = torch.tensor(gaps, device=dev).cumsum(0) - 1  # (b,) index of each row's last token
    if every:  # every token: (N, V), (N, H), scattered below to (b, Q, .)
        last = torch.arange(len(tok_row), device=dev)
    try:
        logits, hidden = decoder_forward(
            model,
            ids,
            mask,
            t["tok_pos"][None],
            cache,
            last_index=(torch.zeros_like(last), last),
        )  # (b, V), (b, H)
    finally:
        cache._packed, cache.varlen, cache._slots = None, None, None
    if every:
        lg = logits.new_zeros((b, q, logits.shape[-1]))
        hd = hidden.new_zeros((b, q, hidden.shape[-1]))
        lg[t["tok_row"], t["tok_j"]], hd[t["tok_row"], t["tok_j"]] = logits, hidden
        logits, hidden = lg, hd
    for s, n in zip(sl, gaps, strict=True):
        cache.lengths[s] += n
    return logits, hidden
