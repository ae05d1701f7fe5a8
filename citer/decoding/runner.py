"""One model's forward calls: :class:`ModelRunner`, the one place that chooses how a call runs.

A runner belongs to one model in one engine and holds that engine's choice for it: ``forward="auto"`` runs the lean
forward (:mod:`citer.decoding.lean`) where it covers the model's family and HF's modules elsewhere, ``"hf"`` always
HF's (the oracle the lean forward is tested against), ``"compiled"`` the lean forward under ``torch.compile``
(:mod:`citer.decoding.compiled`); ``steps`` (a :class:`~citer.decoding.step_compile.StepMode`) runs decode steps and
short catch-ups as fixed-shape calls (:mod:`citer.decoding.static_step`). The choice is the runner's, not the model's:
two engines over one model may run it differently, and nothing outside the engine switches it.

:meth:`ModelRunner.feed` is the engine's one call over a KV pool (:class:`~citer.decoding.kv_cache.RaggedKVCache`):
rows whose caches lag by different gaps append in one forward call, padded (right-padded chunks; pad keys go to the
trash column) or packed (all new tokens in one sequence where padding would double the work or costs more than
packing; the lean forward then runs its linears over the packed tokens and its attention per row). An explicit 4D
mask lets each query see only its own row's valid, causal columns, and prompts are never padded into the cache, so
batching cannot change a logit beyond float rounding. :meth:`ModelRunner.forward` is one causal pass, cached or not,
returning the logits and the router's input (the last layer's output after the final norm).
Shapes: b = rows in a call, Q = longest chunk, K = key columns, V = vocab, H = hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from citer.decoding.compiled import CompiledHidden, compiled_hidden
from citer.decoding.kv_cache import RaggedKVCache
from citer.decoding.lean import LeanDecoder, lean_decoder, unsupported_reason
from citer.decoding.static_step import StaticSteps
from citer.decoding.step_compile import StepMode

FORWARDS = ("auto", "hf", "compiled")

# What packing a call's queries costs per layer (a scatter and a gather, ~20 us on a CPU core), in the multiply-adds
# a core does meanwhile (~250 G/s, the rate of the LLM's products on the Zen 4 host in docs/results.md): an estimate
# that packs a 1.7B LLM's catch-ups at any padding and leaves small models' to the doubling rule.
PACK_COST_MACS = 5_000_000
# Chunks of at most this many tokens run as fixed-shape calls when the runner has ``steps``; longer ones (prompts)
# take the ragged call.
STATIC_Q = 16


class ModelRunner:
    """How one model's calls run in one engine (module docstring)."""

    def __init__(self, model: nn.Module, forward: str = "auto", steps: StepMode | None = None) -> None:
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {list(FORWARDS)}, got {forward!r}")
        self.model, self.forward_kind, self.steps = model, forward, steps
        self._static: StaticSteps | None = None
        self._static_for: LeanDecoder | None = None

    @property
    def lean(self) -> LeanDecoder | None:
        """The model's lean decoder, or None where the runner takes HF's forward."""
        return None if self.forward_kind == "hf" else lean_decoder(self.model)

    @property
    def compiled(self) -> CompiledHidden | None:
        """The compiled lean forward the runner's calls go through (``forward="compiled"``), None when they run
        eagerly: asked for no compile, a family the lean forward does not cover, or a compile that failed."""
        if self.forward_kind != "compiled":
            return None
        lean = lean_decoder(self.model)
        if lean is None:
            return None
        got = compiled_hidden(lean)
        return None if got.failed else got

    @property
    def static(self) -> StaticSteps | None:
        """The fixed-shape steps, where ``steps`` asks for them and the lean forward covers the model."""
        if self.steps is None:
            return None
        lean = self.lean
        if lean is not None and self._static_for is not lean:
            self._static, self._static_for = StaticSteps(lean, self.steps), lean
        return self._static if lean is not None else None

    @property
    def round_shapes(self) -> bool:
        """Whether this model's pools should round their shapes (a few shapes for compiled graphs)."""
        return self.steps is not None or self.compiled is not None

    @property
    def path(self) -> str:
        """``"lean"``, ``"lean+compiled"`` or ``"hf: <reason>"``: which forward this runner's calls take."""
        if self.forward_kind == "hf":
            return "hf: forward='hf'"
        if self.lean is None:
            return f"hf: {unsupported_reason(self.model)}"
        return "lean+compiled" if self.compiled is not None else "lean"

    def new_pool(self) -> RaggedKVCache:
        """An empty KV pool for this model, shaped for how its calls run."""
        pool = RaggedKVCache(self.model, 0, 0, round_shapes=self.round_shapes)
        pool.min_rows = self.steps.min_size if self.steps is not None else 1
        return pool

    # -- one forward call -------------------------------------------------------------------------------------------
    def hidden(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, cache: Any, n_pos: int
    ) -> torch.Tensor:
        """The lean forward's last hidden states (B, T, H) (:meth:`LeanDecoder.hidden`'s arguments), through
        the compiled graphs where the runner compiles and the cache may be traced, eagerly otherwise."""
        lean = self.lean
        assert lean is not None
        compiled = self.compiled
        if (
            compiled is not None
            and getattr(cache, "compiles", cache is None)
            and not torch.compiler.is_compiling()
        ):
            return compiled(ids, pos, mask, cache, n_pos)
        return lean.hidden(ids, pos, mask, cache, n_pos)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        *,
        last_index: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        n_pos: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass: ``(logits, hidden)``, hidden the last layer's output after the final norm -- the one
        definition of the router's input, which the engine, the pools' appends and label collection all read.

        input_ids (B, T) -> logits (B, T, V), hidden (B, T, H); with ``last_index`` (B,) only that position of each
        row: logits (B, V), hidden (B, H) (the head then runs on B vectors, not B*T). A pair (batch_idx (n,), pos_idx
        (n,)) picks n arbitrary positions: logits (n, V), hidden (n, H). ``n_pos``: a bound on the positions known on
        the host (the lean forward otherwise takes it from the mask's key count, or reads the positions back).
        """
        lean = self.lean
        if lean is not None and (
            attention_mask is None or isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
        ):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(
                    input_ids.shape
                )
                n_pos = input_ids.shape[1]
            elif n_pos is None and attention_mask is not None:
                n_pos = attention_mask.shape[
                    -1
                ]  # positions index key columns, so they stay below the key count
            elif n_pos is None:
                n_pos = int(position_ids.max()) + 1
            hidden = self.hidden(input_ids, position_ids, attention_mask, cache, n_pos)  # (B, T, H)
            head = lean.logits
        else:
            out = self.model.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
            )
            hidden = out.last_hidden_state  # (B, T, H)
            head = self.model.get_output_embeddings()
        if isinstance(last_index, tuple):
            hidden = hidden[last_index[0], last_index[1]]  # (n, H)
        elif last_index is not None and hidden.shape[1] == 1:
            hidden = hidden[:, 0]  # (B, H): one token per row, a view instead of a gather
        elif last_index is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]  # (B, H)
        return head(hidden), hidden

    # -- calls over a pool ------------------------------------------------------------------------------------------
    def feed(
        self,
        cache: RaggedKVCache,
        chunks: Sequence[Sequence[int]],
        slots: Sequence[int] | None = None,
        packed: bool | None = None,
        every: bool = False,
        decide: tuple[Sequence[int], Sequence[int], Any] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Feed ``chunks[i]`` to slot ``slots[i]`` (default: slot i) in one forward call.

        An empty chunk holds its row: the row rides along (so a call over the active prefix keeps its cheap views)
        but writes nothing and its returned logits/hidden are meaningless. ``packed``: None chooses -- pack when
        padding would at least double the tokens computed or its pad tokens cost more than packing (catch-ups with
        mixed gaps; compiled, whenever chunks differ in length) and the packed mask stays small, pad otherwise
        (decode steps, where every chunk is one token). Returns logits (b, V) and hidden (b, H) at each row's last
        fed token; ``every``: (b, Q, V), (b, Q, H). ``decide`` = (row ids, step indices, a
        :class:`~citer.decoding.decide.Decision`): a decode step that runs compiled or fixed-shape also returns the
        next step's tokens (b,) and hard flags (b,) from the same graph; otherwise, or when the router cannot be
        traced, only the two.
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
        static = self.static
        if static is not None and not packed and q <= STATIC_Q:
            if decide is not None and q == 1 and not every and sl == list(range(b)):
                return static.decided(cache, chunks, *decide)
            return static(cache, chunks, sl, every=every)
        lean = self.lean
        if packed is None:
            # The packed mask is (N, sum K_i): keep it small, so big prefills stay padded.
            n_keys = sum(cache.lengths[s] for s in sl) + sum(gaps)
            # Eager, packing costs a scatter and a gather of the queries per layer; padding costs the pad tokens'
            # linears: pack where padding would at least double the tokens, or where the pad tokens' multiply-adds
            # exceed what the packing ops cost (a large model's catch-ups). Compiled, those ops fuse away and any
            # padding is wasted matrix work.
            if self.compiled is not None:
                pays = sum(gaps) < b * q
            else:
                waste = (b * q - sum(gaps)) * (lean.layer_macs if lean is not None else 0)
                pays = 2 * sum(gaps) <= b * q or waste >= PACK_COST_MACS
            packed = b > 1 and pays and sum(gaps) * n_keys <= 1 << 22
        if packed:
            return self._packed(cache, chunks, sl, gaps, every)
        cache._kv_len = int(max(cache.lengths[s] + n for s, n in zip(sl, gaps, strict=True)))
        cache._slots = None if sl == list(range(b)) else torch.tensor(sl, dtype=torch.long, device=dev)
        cache._rows = torch.arange(b, device=dev)[:, None] if cache._slots is None else None
        if q == 1:
            out = self._step(cache, chunks, sl, None if every else decide)
            return (out[0][:, None], out[1][:, None]) if every else out
        ids = torch.tensor(
            [list(c) + [c[-1] if c else 0] * (q - len(c)) for c in chunks], dtype=torch.long, device=dev
        )  # (b, Q)
        starts, g, j, pos, mask = self._row_queries(cache, sl, gaps)
        real = j < g[:, None]  # (b, Q)
        cache._cols = torch.where(real, starts[:, None] + j, torch.full_like(pos, cache.capacity))  # (b, Q)
        try:
            # (b, V), (b, H); every: (b, Q, V), (b, Q, H)
            logits, hidden = self.forward(ids, mask, pos, cache, last_index=None if every else g - 1)
        finally:
            cache._slots, cache._cols, cache._rows = None, None, None
        for s, n in zip(sl, gaps, strict=True):
            cache.lengths[s] += n
        return logits, hidden

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        # allowed: (b, 1, Q, K) bool, True = attend. sdpa takes it as is; eager wants an additive float mask.
        # The lean check first: a config attribute read costs more than the lookup (a step reads it once).
        if self.lean is not None or self.model.config._attn_implementation == "sdpa":
            return allowed
        dtype = self.model.get_input_embeddings().weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )

    def _row_queries(
        self, cache: RaggedKVCache, sl: list[int], gaps: list[int]
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
        return starts, g, j, pos, self._mask(allowed[:, None])

    def _step(
        self,
        cache: RaggedKVCache,
        chunks: Sequence[Sequence[int]],
        sl: list[int],
        decide: tuple[Sequence[int], Sequence[int], Any] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The decode step: every chunk one token or empty. The same columns, positions and mask as the padded call,
        built from Python ints in a few tensor ops (a step of a small model is bound by the op count, not the math).
        ``decide``: see :meth:`feed`."""
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
        lean = self.lean
        if pos.count(cache._kv_len - 1) == len(pos) and lean is not None:
            # Every row sits at the last column (batch 1, or rows of one length): each attends all K columns, so the
            # lean forward's attention needs no mask.
            mask = None
        else:
            allowed = torch.arange(cache._kv_len, device=dev) <= step[1][:, :, None]  # (b, 1, K)
            mask = self._mask(allowed[:, None])  # (b, 1, 1, K)
        compiled = self.compiled if decide is not None and cache._slots is None else None
        out = None
        try:
            if compiled is not None and not torch.compiler.is_compiling():
                assert decide is not None
                rid, steps = torch.tensor([list(decide[0]), list(decide[1])], dtype=torch.long, device=dev)
                out = compiled.decided(step[0], step[1], mask, cache, cache._kv_len, rid, steps, decide[2])
            if out is None:
                out = self.forward(
                    step[0], mask, step[1], cache, last_index=step[1][:, 0], n_pos=cache._kv_len
                )
        finally:
            cache._slots, cache._cols, cache._rows = None, None, None
        for s, c in zip(sl, chunks, strict=True):
            cache.lengths[s] += len(c)
        return out

    def _packed(
        self,
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
        if self.lean is not None:
            # Linears over the N packed tokens, attention per row over its own columns (b, Q, K): a block-diagonal
            # mask over every row's keys (N, sum K_i) would score each token against all the rows' keys.
            cache._packed = (slot_t, t["tok_pos"])
            cache._kv_len = max(n + g for n, g in zip(starts, gaps, strict=True))
            cache._slots = t["slots"]
            cache.varlen = (t["tok_row"], t["tok_j"], b, q)
            mask = self._row_queries(cache, sl, gaps)[-1]  # (b, 1, Q, K)
        else:
            key_row = [i for i, (n, g) in enumerate(zip(starts, gaps, strict=True)) for _ in range(n + g)]
            key_col = [c for n, g in zip(starts, gaps, strict=True) for c in range(n + g)]
            k_row = torch.tensor(key_row, dtype=torch.long, device=dev)  # (sum K_i,)
            k_col = torch.tensor(key_col, dtype=torch.long, device=dev)
            cache._packed = (slot_t, t["tok_pos"], t["slots"][k_row], k_col)
            # Token n sees key k iff same row and k's column <= n's position: (N, sum K_i).
            allowed = (k_row[None, :] == t["tok_row"][:, None]) & (k_col[None, :] <= t["tok_pos"][:, None])
            mask = self._mask(allowed[None, None])  # (1, 1, N, sum K_i)
        last = torch.tensor(gaps, device=dev).cumsum(0) - 1  # (b,) index of each row's last token
        if every:  # every token: (N, V), (N, H), scattered below to (b, Q, .)
            last = torch.arange(len(tok_row), device=dev)
        try:
            logits, hidden = self.forward(
                ids, mask, t["tok_pos"][None], cache, last_index=(torch.zeros_like(last), last)
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
