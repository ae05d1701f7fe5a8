"""Routed decoding between a small (SLM) and a large (LLM) model, one token at a time (CITER inference).

Each step, for every active row: the SLM's last-layer hidden state (after the final norm, at the position that
predicts the next token) goes to a router; rows scoring below tau are sent to the LLM, which first catches up on every
token of the row it has not yet seen -- all selected rows in ONE forward call -- and its token replaces the SLM's.
The emitted token is then fed to the SLM. Rows stop at EOS or ``max_new_tokens`` and leave the batch.

Both models keep a :class:`RaggedKVCache`: each row has its own length, so rows whose LLM caches lag by different
gaps are appended to in one call, either padded (right-padded chunk; pad keys go to a trash column) or packed (all
new tokens in one sequence, when padding would double the work). An explicit 4D mask lets each query see only its
own row's valid, causal columns, and prompts are never padded into the cache, so batching cannot change a logit
beyond float rounding. Shapes: b = rows in a call, Q = longest chunk, K = key columns, V = vocab, H = hidden.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from citer.cost import BatchStats, CostMeter, ModelCost, RowStats
from citer.routers import STREAM_SAMPLER, AlwaysSLM, counter_uniform, wants_row_ids

Router = Callable[..., torch.Tensor]


class EngineInputError(ValueError):
    """Bad arguments to the engine; raised before any generation."""


def decoder_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
    *,
    last_index: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a causal LM and return ``(logits, hidden)``; hidden is the last layer's output after the final norm.

    input_ids (B, T) -> logits (B, T, V), hidden (B, T, H); with ``last_index`` (B,) only that position of each row:
    logits (B, V), hidden (B, H) (the head then runs on B vectors, not B*T). A pair (batch_idx (n,), pos_idx (n,))
    picks n arbitrary positions: logits (n, V), hidden (n, H).
    """
    out = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=cache is not None,
    )
    hidden = out.last_hidden_state  # (B, T, H)
    if isinstance(last_index, tuple):
        hidden = hidden[last_index[0], last_index[1]]  # (n, H)
    elif last_index is not None:
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]  # (B, H)
    return model.get_output_embeddings()(hidden), hidden


class RaggedKVCache(Cache):
    """Per-row KV cache: per layer a (R, kv_heads, capacity + 1, head_dim) buffer; row r holds ``lengths[r]`` columns.

    A call either pads (rows x longest chunk; pad keys go to the last column, a trash slot) or packs (all new tokens
    in one sequence, each attending only its own row's columns: no padded compute, at the price of gathering the
    rows' caches into one key sequence). Rows are "slots" in buffer order; ``keep`` compacts
    them when rows finish so the active rows stay a prefix (the common call then uses views, not gathers).
    """

    def __init__(self, model: nn.Module, n_rows: int, capacity: int) -> None:
        super().__init__(layers=[])
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        p = next(model.parameters())
        shape = (n_rows, kv_heads, capacity + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)]
        self.values = [
            torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)
        ]
        self.capacity = capacity
        self.lengths = [0] * n_rows  # valid columns per slot
        # Set by `append` for the duration of one forward call.
        self._slots: torch.Tensor | None = None  # (b,) slot indices, None = the prefix 0..b-1
        self._cols: torch.Tensor | None = None  # (b, Q) column each new key goes to
        self._kv_len = 0
        self._packed: tuple[torch.Tensor, ...] | None = None  # (tok_slot, tok_col, key_slot, key_col)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def keep(self, slots: Sequence[int]) -> None:
        """Keep only ``slots`` (in that order) -- rows that finished are dropped."""
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.keys[0].device)
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.lengths = [self.lengths[s] for s in slots]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: (b, kv_heads, Q, head_dim) -> cache keys/values (b, kv_heads, kv_len, head_dim)
        kbuf, vbuf = self.keys[layer_idx], self.values[layer_idx]
        if self._packed is not None:
            # Packed call: key_states (1, kv_heads, N, head_dim), N new tokens of several rows in one sequence.
            tok_slot, tok_col, key_slot, key_col = self._packed
            kbuf[tok_slot, :, tok_col] = key_states[0].transpose(0, 1)  # (N, kv_heads, head_dim)
            vbuf[tok_slot, :, tok_col] = value_states[0].transpose(0, 1)
            # Every selected row's valid columns, concatenated: (1, kv_heads, sum K_i, head_dim).
            return (
                kbuf[key_slot, :, key_col].transpose(0, 1)[None],
                vbuf[key_slot, :, key_col].transpose(0, 1)[None],
            )
        b = key_states.shape[0]
        cols = self._cols  # (b, Q)
        if self._slots is None:
            rows = torch.arange(b, device=cols.device)[:, None]  # (b, 1)
            kbuf[rows, :, cols] = key_states.transpose(1, 2)  # indexed dims first: (b, Q, kv_heads, head_dim)
            vbuf[rows, :, cols] = value_states.transpose(1, 2)
            return kbuf[:b, :, : self._kv_len], vbuf[:b, :, : self._kv_len]
        rows = self._slots[:, None]
        kbuf[rows, :, cols] = key_states.transpose(1, 2)
        vbuf[rows, :, cols] = value_states.transpose(1, 2)
        # A gather: the selected rows' caches, cut to the longest (b, kv_heads, kv_len, head_dim).
        return (
            kbuf[:, :, : self._kv_len].index_select(0, self._slots),
            vbuf[:, :, : self._kv_len].index_select(0, self._slots),
        )


def _mask_for(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    # allowed: (b, 1, Q, K) bool, True = attend. sdpa takes it as is; eager wants an additive float mask.
    impl = model.config._attn_implementation
    if impl == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def ragged_append(
    model: nn.Module,
    cache: RaggedKVCache,
    chunks: Sequence[Sequence[int]],
    slots: Sequence[int] | None = None,
    packed: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``chunks[i]`` (>= 1 token) to slot ``slots[i]`` (default: slot i) in one forward call.

    ``packed``: None chooses -- pack when padding would at least double the tokens computed (catch-up calls with
    mixed gaps) and the packed mask stays small, pad otherwise (decode steps, where every chunk is one token). Returns logits (b, V) and
    hidden (b, H) at each row's last fed token.
    """
    dev = cache.keys[0].device
    b = len(chunks)
    sl = list(range(b)) if slots is None else list(slots)
    gaps = [len(c) for c in chunks]
    q = max(gaps)
    if packed is None:
        # The packed mask is (N, sum K_i): keep it small, so big prefills stay padded.
        n_keys = sum(cache.lengths[s] for s in sl) + sum(gaps)
        packed = b > 1 and 2 * sum(gaps) <= b * q and sum(gaps) * n_keys <= 1 << 22
    if packed:
        return _packed_append(model, cache, chunks, sl, gaps)
    starts = torch.tensor([cache.lengths[s] for s in sl], dtype=torch.long, device=dev)  # (b,)
    g = torch.tensor(gaps, dtype=torch.long, device=dev)  # (b,)
    ids = torch.tensor(
        [list(c) + [c[-1]] * (q - len(c)) for c in chunks], dtype=torch.long, device=dev
    )  # (b, Q)
    j = torch.arange(q, device=dev)[None, :]  # (1, Q)
    real = j < g[:, None]  # (b, Q)
    # Pad queries repeat the last real position, so they see exactly the row's valid columns (never all-masked).
    pos = starts[:, None] + torch.minimum(j, g[:, None] - 1)  # (b, Q)
    cache._cols = torch.where(real, starts[:, None] + j, torch.full_like(pos, cache.capacity))  # (b, Q)
    cache._kv_len = int(max(cache.lengths[s] + n for s, n in zip(sl, gaps, strict=True)))
    cache._slots = None if sl == list(range(b)) else torch.tensor(sl, dtype=torch.long, device=dev)
    allowed = torch.arange(cache._kv_len, device=dev)[None, None, :] <= pos[:, :, None]  # (b, Q, K)
    mask = _mask_for(model, allowed[:, None])  # (b, 1, Q, K)
    try:
        logits, hidden = decoder_forward(
            model, ids, {"full_attention": mask}, pos, cache, last_index=g - 1
        )  # (b, V), (b, H)
    finally:
        cache._slots, cache._cols = None, None
    for s, n in zip(sl, gaps, strict=True):
        cache.lengths[s] += n
    return logits, hidden


def _packed_append(
    model: nn.Module, cache: RaggedKVCache, chunks: Sequence[Sequence[int]], sl: list[int], gaps: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = cache.keys[0].device
    tok_row, tok_pos, key_row, key_col, key_slot = [], [], [], [], []
    for i, (s, n) in enumerate(zip(sl, gaps, strict=True)):
        start = cache.lengths[s]
        tok_row += [i] * n
        tok_pos += range(start, start + n)
        key_row += [i] * (start + n)
        key_col += range(start + n)
        key_slot += [s] * (start + n)
    t = {k: torch.tensor(v, dtype=torch.long, device=dev) for k, v in
         dict(tok_row=tok_row, tok_pos=tok_pos, key_row=key_row, key_col=key_col, key_slot=key_slot).items()}  # fmt: skip
    ids = torch.tensor([[x for c in chunks for x in c]], dtype=torch.long, device=dev)  # (1, N)
    slot_t = torch.tensor(sl, dtype=torch.long, device=dev)[t["tok_row"]]  # (N,)
    cache._packed = (slot_t, t["tok_pos"], t["key_slot"], t["key_col"])
    # Token n sees key k iff same row and k's column <= n's position: (N, sum K_i).
    allowed = (t["key_row"][None, :] == t["tok_row"][:, None]) & (
        t["key_col"][None, :] <= t["tok_pos"][:, None]
    )
    mask = _mask_for(model, allowed[None, None])  # (1, 1, N, sum K_i)
    last = torch.tensor(gaps, device=dev).cumsum(0) - 1  # (b,) index of each row's last token
    try:
        logits, hidden = decoder_forward(
            model,
            ids,
            {"full_attention": mask},
            t["tok_pos"][None],
            cache,
            last_index=(torch.zeros_like(last), last),
        )  # (b, V), (b, H)
    finally:
        cache._packed = None
    for s, n in zip(sl, gaps, strict=True):
        cache.lengths[s] += n
    return logits, hidden


def select_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    seed: int,
    row_ids: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Greedy (temperature 0) or temperature/top-p sampling. logits (b, V) -> tokens (b,).

    Sampling is an exponential race on counter-based uniforms of (seed, row id, step, token id), so a row draws the
    same token whatever else is in its batch.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (b, V)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()  # mass strictly above each token
        drop_sorted = before >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    dev = logits.device
    u = counter_uniform(seed, STREAM_SAMPLER, row_ids.to(dev), steps.to(dev), logits.shape[-1])  # (b, V)
    gumbel = -torch.log(-torch.log(u))  # (b, V) float64
    return (logp.double() + gumbel).argmax(dim=-1)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when emitted, nothing after it
    from_llm: list[list[bool]]  # per new token: True when the LLM wrote it
    rows: list[RowStats]
    batch: BatchStats


def _vocab(model: nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).vocab_size)


def _max_positions(model: nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).max_position_embeddings)


class RoutedEngine:
    """Token-level routed generation. ``llm=None`` is allowed with an :class:`~citer.routers.AlwaysSLM` router.

    ``eos_token_id``: one id or several (None: stop at ``max_new_tokens`` only). ``pad_token_id`` is accepted for
    symmetry with HF; the engine never needs it (pad slots repeat a real token and are masked). ``gpu`` names the
    bandwidth used for the projected time (:data:`citer.cost.GPU_BANDWIDTH`).
    """

    def __init__(
        self,
        slm: nn.Module,
        llm: nn.Module | None,
        router: Router,
        tau: float = 0.5,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        gpu: str = "H100",
    ) -> None:
        if not isinstance(tau, int | float) or not 0.0 <= float(tau) <= 1.0:
            raise EngineInputError(f"tau must lie in [0, 1], got {tau!r}")
        if llm is None and not isinstance(router, AlwaysSLM):
            raise EngineInputError("llm=None needs an AlwaysSLM router (no LLM to route to)")
        if llm is not None and _vocab(slm) != _vocab(llm):
            raise EngineInputError(
                f"models have different vocabularies: slm vocab_size={_vocab(slm)}, llm vocab_size={_vocab(llm)}"
            )
        for name, m in (("slm", slm), ("llm", llm)):
            if m is None:
                continue
            impl = m.config._attn_implementation
            if impl not in ("sdpa", "eager"):
                raise EngineInputError(
                    f"{name}: attention implementation {impl!r} unsupported; use sdpa or eager"
                )
            kinds = set(
                getattr(m.config.get_text_config(decoder=True), "layer_types", None) or ["full_attention"]
            )
            if kinds != {"full_attention"}:
                raise EngineInputError(
                    f"{name}: only full-attention layers are supported, got {sorted(kinds)}"
                )
        self.slm, self.llm, self.router, self.tau = slm, llm, router, float(tau)
        eos = (
            [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        )
        self.eos = set(int(e) for e in eos)
        self.pad_token_id = pad_token_id
        self.gpu = gpu
        self._router_ctx = wants_row_ids(router)
        self._cost_slm = ModelCost.from_model(slm)
        self._cost_llm = ModelCost.from_model(llm) if llm is not None else None

    def _check(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, row_ids: Sequence[int] | None
    ) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompts) == 0:
            raise EngineInputError("prompts: empty list, nothing to generate")
        if row_ids is not None and (len(row_ids) != len(prompts) or len(set(row_ids)) != len(row_ids)):
            raise EngineInputError(f"row_ids: need {len(prompts)} distinct ids, got {list(row_ids)[:8]}...")
        vocab = _vocab(self.slm)
        limits = [("slm", _max_positions(self.slm))]
        if self.llm is not None:
            limits.append(("llm", _max_positions(self.llm)))
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise EngineInputError(f"prompts[{i}]: empty prompt")
            bad = [t for t in p if not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
            if bad:
                raise EngineInputError(f"prompts[{i}]: token ids outside [0, {vocab}): {bad[:5]}")
            for name, mx in limits:
                if len(p) > mx - max_new_tokens:
                    raise EngineInputError(
                        f"prompts[{i}]: {len(p)} tokens is longer than the {name} context allows "
                        f"(max_position_embeddings {mx} - max_new_tokens {max_new_tokens} = {mx - max_new_tokens})"
                    )

    def generate(self, prompt: Sequence[int], max_new_tokens: int, **kwargs) -> GenerationResult:
        """One row: ``generate_batch([prompt], ...)``."""
        return self.generate_batch([prompt], max_new_tokens, **kwargs)

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        row_ids: Sequence[int] | None = None,
    ) -> GenerationResult:
        """Generate for every prompt. ``row_ids`` (default 0..n-1) key the random router and the sampler, so a
        caller splitting a long list into batches passes each row's global index to keep results batch-invariant."""
        self._check(prompts, max_new_tokens, row_ids)
        if temperature < 0.0 or not 0.0 < top_p <= 1.0:
            raise EngineInputError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        t0 = time.perf_counter()
        n = len(prompts)
        ids = list(range(n)) if row_ids is None else [int(r) for r in row_ids]
        seqs = [list(map(int, p)) for p in prompts]
        plen = [len(p) for p in prompts]
        cap = max(plen) + max_new_tokens
        dev = next(self.slm.parameters()).device
        meter = CostMeter(self._cost_slm, self._cost_llm, n, self.gpu)
        out_tok: list[list[int]] = [[] for _ in range(n)]
        out_llm: list[list[bool]] = [[] for _ in range(n)]

        slm_cache = RaggedKVCache(self.slm, n, cap)
        llm_cache = RaggedKVCache(self.llm, n, cap) if self.llm is not None else None
        llm_seen = [0] * n  # tokens of row r in the LLM cache
        active = list(range(n))  # slot -> row

        logits, hidden = ragged_append(self.slm, slm_cache, seqs)  # prefill: (n, V), (n, H)
        meter.forward("slm", active, plen, plen)
        step = 0
        while active:
            b = len(active)
            rid = torch.tensor([ids[r] for r in active], dtype=torch.long)  # (b,) on CPU: keys for the noise
            steps = torch.full((b,), step, dtype=torch.long)
            if self._router_ctx:
                scores = self.router(hidden.float(), row_ids=rid.to(dev), steps=steps.to(dev))
            else:
                scores = self.router(hidden.float())
            scores = scores.reshape(-1)
            if scores.shape[0] != b:
                raise ValueError(f"router returned {tuple(scores.shape)} scores for {b} rows")
            tok = select_tokens(logits, temperature, top_p, seed, rid, steps)  # (b,)
            to_llm = (scores < self.tau).tolist()
            sel = [s for s in range(b) if to_llm[s]]
            if sel:
                if llm_cache is None:
                    raise ValueError("router sent a token to the LLM but the engine has llm=None")
                rows = [active[s] for s in sel]
                chunks = [seqs[r][llm_seen[r] :] for r in rows]
                llm_logits, _ = ragged_append(self.llm, llm_cache, chunks, slots=sel)  # (len(sel), V)
                meter.forward("llm", rows, [len(c) for c in chunks], [len(seqs[r]) for r in rows])
                meter.llm_fed(
                    rows,
                    [max(plen[r] - llm_seen[r], 0) for r in rows],
                    [len(seqs[r]) - max(llm_seen[r], plen[r]) for r in rows],
                )
                for r in rows:
                    llm_seen[r] = len(seqs[r])
                llm_tok = select_tokens(llm_logits, temperature, top_p, seed, rid[sel], steps[sel])
                tok[torch.tensor(sel, device=tok.device)] = llm_tok.to(tok.device)
            toks = tok.tolist()
            meter.emitted(active, to_llm)
            keep = []
            for s, r in enumerate(active):
                seqs[r].append(toks[s])
                out_tok[r].append(toks[s])
                out_llm[r].append(bool(to_llm[s]))
                if toks[s] not in self.eos and len(out_tok[r]) < max_new_tokens:
                    keep.append(s)
            step += 1
            if not keep:
                break
            if len(keep) < b:  # rows finished: drop them from both caches so they are never computed again
                slm_cache.keep(keep)
                if llm_cache is not None:
                    llm_cache.keep(keep)
                active = [active[s] for s in keep]
            feed = [[seqs[r][-1]] for r in active]
            logits, hidden = ragged_append(self.slm, slm_cache, feed)  # (b', V), (b', H)
            meter.forward("slm", active, [1] * len(active), [len(seqs[r]) for r in active])
        row_stats, batch = meter.finish(time.perf_counter() - t0)
        return GenerationResult(tokens=out_tok, from_llm=out_llm, rows=row_stats, batch=batch)
