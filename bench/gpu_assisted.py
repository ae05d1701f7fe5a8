"""Transformers assisted generation (``generate(assistant_model=slm)``) at batch 1, the speculative baseline that
routing is compared with at equal LLM calls per token; and the logits processor that makes random models agree at a
controlled rate (random models never agree on their own), which also masks the ids the two models do not share."""

from __future__ import annotations

import statistics

import torch

from bench.gpu_pairs import BuiltPair
from bench.gpu_run import BenchRun
from bench.gpu_timing import call_counter, interpolate, routed_curve
from citer.decoding.cost import GPU_BANDWIDTH
from citer.decoding.speculative import assistant_setup


class AgreeProcessor:
    """transformers logits processor for assisted generation: masks ids >= ``vocab`` (the pair's shared ids) and, at a
    pseudo-random fraction ``alpha`` of positions (a hash of the prefix's length and last token), forces one token
    derived from the prefix. Applied to both models, they then agree exactly there: a controlled acceptance rate."""

    def __init__(self, vocab: int, alpha: float) -> None:
        self.vocab, self.alpha = int(vocab), float(alpha)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] > self.vocab:
            scores = scores.clone()
            scores[:, self.vocab :] = float("-inf")
        if self.alpha <= 0.0:
            return scores
        m = 0xFFFFFFFF
        last = input_ids[:, -1].to(torch.int64)  # (B,)
        h = (last * 0x9E3779B1 + input_ids.shape[1] * 0x85EBCA77) & m
        h = h ^ (h >> 15)
        h = (h * 0x2C1B3C6D) & m
        h = h ^ (h >> 12)
        h = (h * 0x297A2D39) & m
        h = h ^ (h >> 15)
        forced = (h.to(torch.float64) / 4294967296.0) < self.alpha  # (B,)
        tok = (h >> 7) % self.vocab  # (B,)
        target = torch.full_like(scores, float("-inf")).scatter_(1, tok[:, None], 0.0)
        return torch.where(forced[:, None], target, scores)


def measure_assisted(
    run: BenchRun, models: BuiltPair, ids: torch.Tensor, t_tok: dict[str, float], done: list[dict]
) -> list[dict]:
    """Assisted generation at batch 1: natural acceptance and forced agreement at each ``--alphas``. ``ids``: the
    batch-1 prompt (1, P); ``t_tok``: seconds per token of the variants measured on it, by name; ``done``: their rows
    (the routed curve that assisted is compared with at equal LLM calls per token)."""
    from transformers import LogitsProcessorList

    pair, slm, llm, costs, vocab = models.name, models.slm, models.llm, models.costs, models.vocab
    a = run.args
    n_new = a.new_tokens
    rows = []
    for alpha in [0.0, *a.alphas]:
        name = f"assisted_alpha{alpha:g}"
        if run.left() < 20:
            run.note(f"{pair} {name}: skipped, time budget spent")
            continue
        proc = LogitsProcessorList([AgreeProcessor(vocab, alpha)])

        n_tok = a.assisted_tokens if alpha == 0.0 else n_new  # ~k+1 forward calls per token: keep it short
        reps = 1 if alpha == 0.0 else a.reps

        def go(n: int, proc=proc) -> tuple[torch.Tensor, dict]:
            with assistant_setup(slm, llm, a.draft_tokens), call_counter(slm, llm, costs, 1) as tally:
                out = llm.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=slm, max_new_tokens=n,
                    do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=proc,
                )  # fmt: skip
            return out, dict(tally)

        try:
            run.timed(lambda go=go, k=a.warmup_tokens or n_tok: go(k))
            walls, tally, gen = [], {}, None
            for _ in range(reps):
                sec, (gen, tally) = run.timed(lambda go=go, n_tok=n_tok: go(n_tok))
                walls.append(sec)
        except Exception as exc:
            run.error(f"{pair} {name}", exc)
            continue
        med = statistics.median(walls)
        got = int(gen.shape[1] - ids.shape[1])
        t = med / got
        llm_calls = tally["llm_calls"]  # verification calls (and a prefill, if transformers makes one)
        row = {
            "pair": pair, "batch": 1, "variant": name, "method": "hf_assisted", "alpha": alpha,
            "draft_tokens": a.draft_tokens, "new_tokens": got, "prompt_len": a.prompt_len,
            "reps_s": [round(w, 5) for w in walls], "wall_s": med, "ms_per_token": 1e3 * t,
            "ms_per_row_token": 1e3 * t, "tokens_per_s": 1 / t, "llm_calls": llm_calls,
            "slm_calls": tally["slm_calls"], "llm_calls_per_token": llm_calls / got,
            "llm_calls_per_step": llm_calls / got,
            "tokens_per_llm_call": got / llm_calls,
            # approx.: each verification call checks draft_tokens drafts and adds one token of the LLM's own
            "draft_acceptance_approx": max(0.0, (got - llm_calls) / (llm_calls * a.draft_tokens)),
            "bytes_per_token": tally["bytes"] / got,
        }  # fmt: skip
        bw = row["bytes_per_token"] / GPU_BANDWIDTH[a.gpu]
        row["bw_limit_ms_per_token"] = 1e3 * bw
        row["ratio_to_bw"] = t / bw
        # Routed at the same LLM calls per token: ideal f * t_LLM + t_SLM and the routed curve interpolated.
        c = row["llm_calls_per_token"]
        if "engine_slm" in t_tok and "engine_llm" in t_tok:
            ideal = c * t_tok["engine_llm"] + t_tok["engine_slm"]
            row["routed_ideal_ms_at_same_llm_calls"] = 1e3 * ideal
        routed = routed_curve(done)
        if routed:
            row["routed_ms_at_same_llm_calls"] = 1e3 * interpolate(routed, c)
            row["assisted_over_routed"] = t / interpolate(routed, c)
        rows.append(row)
    return rows
