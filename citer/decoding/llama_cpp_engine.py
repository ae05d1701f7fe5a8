""":class:`LlamaCppEngine`: the routed engine's batch interface (``generate_batch``, its :class:`GenerationResult`
with per-row costs) with both models on llama.cpp, so ``citer route`` and the sweep's passes run on the runner
``engine.runner: llama_cpp`` names, and τ is chosen on the runner that serves. The pair's models are GGUF files
(:func:`citer.models.to_gguf.gguf_for` converts and quantizes the pipeline's own); the decoding is
:func:`~citer.decoding.llama_cpp_routed.routed_generate`. Costs are metered like the torch engine's, at the files'
own bytes (a 4-bit file reads a quarter of the bf16 weights) and llama.cpp's F16 KV cache.

Not here (the torch engine's): step-level sessions (``citer serve``'s streaming scheduler), verified routing, shared
LLM calls, drafts.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

from citer.decoding.baselines import AlwaysSLM, Router, router_read_bytes
from citer.decoding.cost import CostMeter
from citer.decoding.engine import GenerationResult
from citer.decoding.llama_cpp_routed import routed_generate
from citer.decoding.llama_cpp_runner import LlamaCppModel
from citer.decoding.rows import EngineInputError, check_prompts, check_sampling

MAX_SEQUENCES = 256  # llama.cpp's limit on a context's sequence ids (LLAMA_MAX_SEQ); more rows take turns


class LlamaCppEngine:
    """Routed generation on llama.cpp between the GGUF files ``slm`` and ``llm`` (``llm=None``: the SLM alone, with
    an :class:`AlwaysSLM` router). ``eos_token_id``: one id or several; ``vocab_size``: the ids the models share
    (default the smaller vocabulary); ``gpu``: the bandwidth named for projected seconds, as the torch engine's."""

    runner = "llama_cpp"

    def __init__(
        self,
        slm: str | os.PathLike[str],
        llm: str | os.PathLike[str] | None,
        router: Router,
        tau: float = 0.5,
        eos_token_id: int | Sequence[int] | None = None,
        vocab_size: int | None = None,
        gpu: str = "H100",
        rows: int = 8,
    ) -> None:
        if not isinstance(tau, int | float) or not 0.0 <= float(tau) <= 1.0:
            raise EngineInputError(f"tau must lie in [0, 1], got {tau!r}")
        if llm is None and not isinstance(router, AlwaysSLM):
            raise EngineInputError("llm=None needs an AlwaysSLM router (no LLM to route to)")
        self.router, self.tau, self.gpu = router, float(tau), gpu
        self.eos = [] if eos_token_id is None else [int(eos_token_id)] if isinstance(eos_token_id, int) else [
            int(e) for e in eos_token_id
        ]  # fmt: skip
        self.slm = LlamaCppModel(Path(slm), rows, 64, hidden=llm is not None)
        self.llm = LlamaCppModel(Path(llm), rows, 64) if llm is not None else None
        models = [self.slm] if self.llm is None else [self.slm, self.llm]
        self.vocab_size = vocab_size or min(m.vocab_size for m in models)
        self.router_bytes = router_read_bytes(router, None) if self.llm is not None else 0
        self.cost_slm = self.slm.cost().plus(self.router_bytes)
        self.cost_llm = self.llm.cost() if self.llm is not None else None

    def close(self) -> None:
        for m in (self.slm, self.llm):
            if m is not None:
                m.close()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, **kwargs) -> GenerationResult:
        """One row: ``generate_batch([prompt], ...)``."""
        return self.generate_batch([prompt], max_new_tokens, **kwargs)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        row_ids: Sequence[int] | None = None,
        max_rows: int | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Generate for every prompt, at most ``max_rows`` (default all, at most :data:`MAX_SEQUENCES`) at once, rows
        joining as others finish; ``row_ids`` (default 0..n-1) key the random router and the sampler, as in the torch
        engine."""
        models = [self.slm] if self.llm is None else [self.slm, self.llm]
        check_prompts(prompts, max_new_tokens, row_ids, self.vocab_size,
                      [(n, m.max_positions) for n, m in zip(("slm", "llm"), models, strict=False)])  # fmt: skip
        check_sampling(temperature, top_p)
        if drafts is not None and any(drafts):
            raise EngineInputError("drafts: the llama.cpp runner takes none (engine.runner: torch does)")
        if max_rows is not None and max_rows < 1:
            raise EngineInputError(f"max_rows must be >= 1, got {max_rows}")
        rows = min(len(prompts), max_rows or len(prompts), MAX_SEQUENCES)
        need = max(len(p) for p in prompts) + max_new_tokens
        for m in models:
            m.fit(rows, 1 << math.ceil(math.log2(need)))  # powers of two: few context rebuilds
        meter = CostMeter(self.cost_slm, self.cost_llm, len(prompts), self.gpu)
        t0 = time.perf_counter()
        run = routed_generate(
            self.slm, self.llm, prompts, self.router if self.llm is not None else None, self.tau, max_new_tokens,
            self.eos, (float(temperature), float(top_p), int(seed)), row_ids, self.vocab_size, meter, rows,
        )  # fmt: skip
        stats, batch = meter.finish(time.perf_counter() - t0)
        return GenerationResult(run.tokens, run.from_llm, stats, batch, [[] for _ in prompts])
