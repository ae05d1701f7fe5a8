"""Routed decoding between a small (SLM) and a large (LLM) model, one token at a time (CITER inference).

Each step, for every active row: the SLM's last-layer hidden state (after the final norm, at the position that
predicts the next token) goes to a router; rows scoring below tau are sent to the LLM, which first catches up on every
token of the row it has not yet seen -- all selected rows in ONE forward call -- and its token replaces the SLM's.
The emitted token is then fed to the SLM. Rows stop at EOS or ``max_new_tokens`` and leave the batch.

Both models keep a :class:`~citer.decoding.kv_cache.RaggedKVCache`, so rows of different lengths share every call.
Shapes: b = rows in a call, V = vocab, H = hidden. Logits are cut to the tokenizer's vocabulary before a token is
chosen (:mod:`citer.decoding.pairing`), so the models' embeddings may be padded to different sizes.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from citer.decoding.baselines import AlwaysSLM, Router, router_read_bytes, wants_row_ids
from citer.decoding.cost import BatchStats, CostMeter, ModelCost, RowStats
from citer.decoding.kv_cache import RaggedKVCache, ragged_append
from citer.decoding.pairing import (
    PairingError,
    check_full_attention,
    cut_logits,
    model_label,
    shared_vocab_size,
)
from citer.decoding.sampling import select_tokens


class EngineInputError(ValueError):
    """Bad arguments to the engine; raised before any generation."""


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when emitted, nothing after it
    from_llm: list[list[bool]]  # per new token: True when the LLM wrote it
    rows: list[RowStats]
    batch: BatchStats


def _max_positions(model: nn.Module) -> int:
    return int(model.config.get_text_config(decoder=True).max_position_embeddings)


class RoutedEngine:
    """Token-level routed generation. ``llm=None`` is allowed with an :class:`~citer.decoding.baselines.AlwaysSLM` router.

    ``eos_token_id``: one id or several (None: stop at ``max_new_tokens`` only). ``pad_token_id`` is accepted for
    symmetry with HF; the engine never needs it (pad slots repeat a real token and are masked). ``gpu`` names the
    bandwidth used for the projected time (:data:`citer.decoding.cost.GPU_BANDWIDTH`). ``vocab_size``: the token ids
    the models share, ``len(tokenizer)`` (default: the smaller embedding); logits are cut to it before any choice, so
    models whose embeddings are padded to different sizes pair as long as their tokenizers agree.
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
        vocab_size: int | None = None,
    ) -> None:
        if not isinstance(tau, int | float) or not 0.0 <= float(tau) <= 1.0:
            raise EngineInputError(f"tau must lie in [0, 1], got {tau!r}")
        if llm is None and not isinstance(router, AlwaysSLM):
            raise EngineInputError("llm=None needs an AlwaysSLM router (no LLM to route to)")
        for m in (slm, llm):
            if m is None:
                continue
            impl = m.config._attn_implementation
            if impl not in ("sdpa", "eager"):
                raise EngineInputError(
                    f"{model_label(m)}: attention implementation {impl!r} unsupported; use sdpa or eager"
                )
        try:
            for m in (slm, llm):
                if m is not None:
                    check_full_attention(m.config, model_label(m))
            # Embedding sizes may differ (padded rows); the token ids both may emit are the tokenizer's.
            self.vocab_size = shared_vocab_size(slm, llm, vocab_size)
        except PairingError as exc:
            raise EngineInputError(str(exc)) from exc
        self.slm, self.llm, self.router, self.tau = slm, llm, router, float(tau)
        eos = (
            [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        )
        self.eos = set(int(e) for e in eos)
        self.pad_token_id = pad_token_id
        self.gpu = gpu
        self._router_ctx = wants_row_ids(router)
        # The router runs at every SLM step, so its reads join the SLM's (docs/cost_model.md).
        self.router_bytes = router_read_bytes(router, slm)
        self._cost_slm = ModelCost.from_model(slm).plus(self.router_bytes)
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
        vocab = self.vocab_size
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
        meter = CostMeter(self._cost_slm, self._cost_llm, n, self.gpu)
        out_tok: list[list[int]] = [[] for _ in range(n)]
        out_llm: list[list[bool]] = [[] for _ in range(n)]

        slm_cache = RaggedKVCache(self.slm, n, cap)
        llm_cache = RaggedKVCache(self.llm, n, cap) if self.llm is not None else None
        llm_seen = [0] * n  # tokens of row r in the LLM cache
        active = list(range(n))  # slot -> row

        logits, hidden = ragged_append(self.slm, slm_cache, seqs)  # prefill: (n, V_slm), (n, H)
        meter.forward("slm", active, plen, plen)
        step = 0
        while active:
            b = len(active)
            rid = torch.tensor([ids[r] for r in active], dtype=torch.long)  # (b,) on CPU: keys for the noise
            steps = torch.full((b,), step, dtype=torch.long)
            if self._router_ctx:
                dev = hidden.device
                scores = self.router(hidden.float(), row_ids=rid.to(dev), steps=steps.to(dev))
            else:
                scores = self.router(hidden.float())
            scores = scores.reshape(-1)
            if scores.shape[0] != b:
                raise ValueError(f"router returned {tuple(scores.shape)} scores for {b} rows")
            tok = select_tokens(
                cut_logits(logits, self.vocab_size), temperature, top_p, seed, rid, steps
            )  # (b,)
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
                llm_tok = select_tokens(
                    cut_logits(llm_logits, self.vocab_size), temperature, top_p, seed, rid[sel], steps[sel]
                )
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
