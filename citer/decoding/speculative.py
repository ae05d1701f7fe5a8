"""Speculative decoding: transformers' assisted generation, metered like the routed engine.

``llm.generate(assistant_model=slm)`` is lossless under greedy decoding (its output is the LLM's), so what it adds to
a comparison is cost: every forward call of either model is caught by a pre-hook and charged through
:class:`citer.decoding.cost.CostMeter` exactly as the engine charges its own calls. Assisted generation takes batch
size 1, so each prompt is decoded alone. Both models' tokens are chosen among the tokenizer's ids (``vocab_size``),
so a pair whose embeddings are padded to different sizes decodes as one with equal embeddings would.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from citer.decoding.cost import CostMeter, ModelCost, forward_calls
from citer.decoding.pairing import VocabCut, embedding_rows, input_device
from citer.ops.progress import progress


@dataclass(frozen=True)
class SpeculativeOutput:
    """One prompt decoded alone (batch 1): its tokens and what the calls moved."""

    tokens: list[int]  # new tokens, EOS included when emitted, nothing after it
    slm_calls: int
    llm_calls: int  # verification calls; each emits exactly one token of the LLM's own
    bytes_moved: float  # every call reads the whole weights (batch 1), plus the KV it reads and writes
    weight_bytes: float  # the part of ``bytes_moved`` that is weight reads
    wall_seconds: float


@contextlib.contextmanager
def assistant_setup(slm: Any, llm: Any, draft_tokens: int) -> Iterator[None]:
    """For the block: a deterministic draft schedule for ``slm`` as ``llm``'s assistant, and one tokenizer's ids."""
    from transformers.utils import logging as hf_logging

    gen_cfg = slm.generation_config
    draft_cfg = copy.deepcopy(gen_cfg)
    # A constant draft length and no adaptive confidence cut keep runs reproducible (the defaults adapt across calls).
    draft_cfg.num_assistant_tokens = draft_tokens
    draft_cfg.num_assistant_tokens_schedule = "constant"
    draft_cfg.assistant_confidence_threshold = 0.0
    slm.generation_config = draft_cfg
    # transformers takes different embedding sizes for different tokenizers and then wants both tokenizers
    # (universal assisted decoding, which re-tokenizes text). Ours share one tokenizer and VocabCut keeps both models
    # on its ids, so for the block the assistant reports the LLM's width; greedy verification compares ids only.
    slm_text_cfg = slm.config.get_text_config(decoder=True)
    slm_rows = embedding_rows(slm)
    slm_text_cfg.vocab_size = embedding_rows(llm)
    verbosity = hf_logging.get_verbosity()
    # Assisted generation warns on every call about its internal generation_config; once is plenty.
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        slm_text_cfg.vocab_size = slm_rows
        slm.generation_config = gen_cfg


@torch.no_grad()
def speculative_generate(
    slm: Any,
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    draft_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    gpu: str = "H100",
    vocab_size: int | None = None,
) -> list[SpeculativeOutput]:
    """``llm.generate(assistant_model=slm)`` greedily for each prompt alone, every call metered; tokens among the
    first ``vocab_size`` ids (``len(tokenizer)``; default the smaller embedding)."""
    from transformers import LogitsProcessorList

    dev = input_device(llm)
    cut = LogitsProcessorList([VocabCut(vocab_size or min(embedding_rows(slm), embedding_rows(llm)))])
    costs = (ModelCost.from_model(slm), ModelCost.from_model(llm))
    meter: CostMeter  # the current prompt's: every forward call is charged to it
    out = []

    def charge(which: str, new: int, seen: int) -> None:
        meter.forward(which, [0], [new], [seen + new])  # type: ignore[arg-type]

    with forward_calls(slm, llm, charge), assistant_setup(slm, llm, draft_tokens):
        for p in progress(prompts, desc="speculative", total=len(prompts), unit="prompt"):
            meter = CostMeter(costs[0], costs[1], 1, gpu)
            ids = torch.tensor([list(p)], dtype=torch.long, device=dev)  # (1, T)
            t0 = time.perf_counter()
            gen = llm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=slm,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                logits_processor=cut,
            )
            wall = time.perf_counter() - t0
            toks = gen[0, ids.shape[1] :].tolist()
            toks = toks[: toks.index(eos_token_id) + 1] if eos_token_id in toks else toks
            stats, batch = meter.finish(0.0)
            weights = batch.slm_calls * costs[0].weight_bytes + batch.llm_calls * costs[1].weight_bytes
            out.append(
                SpeculativeOutput(
                    tokens=toks,
                    slm_calls=int(batch.slm_calls),
                    llm_calls=int(batch.llm_calls),
                    bytes_moved=float(stats[0].bytes_moved),
                    weight_bytes=float(weights),
                    wall_seconds=wall,
                )
            )
    return out
