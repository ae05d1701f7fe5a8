"""Transformers ``generate`` with a static cache (``--compile``), which makes it compile the decode step with
``torch.compile(mode="reduce-overhead")`` (CUDA graphs): the fastest LLM-only baseline, its compile time reported
beside it in the pair's ``compile`` entry."""

from __future__ import annotations

import statistics

import torch

from bench.gpu_assisted import AgreeProcessor
from bench.gpu_pairs import BuiltPair
from bench.gpu_run import BenchRun
from bench.gpu_timing import plain_bytes
from citer.decoding.cost import GPU_BANDWIDTH


def measure_static_compiled(run: BenchRun, models: BuiltPair) -> None:
    """``hf_{llm,slm}_static_compiled`` rows at each ``--compile-batches`` for the ``--compile-models``, each skipped
    when fewer than ``--compile-reserve`` seconds are left (a compile takes minutes at real shapes)."""
    pair, slm, llm, costs, vocab = models.name, models.slm, models.llm, models.costs, models.vocab
    a = run.args
    from transformers import LogitsProcessorList

    comp = run.report["pairs"][pair]["compile"]
    models = [(k, m) for k, m in (("llm", llm), ("slm", slm)) if k in a.compile_models.split(",")]
    for key, model in models:
        for batch in a.compile_batches:
            name = f"hf_{key}_static_compiled"
            if run.left() < a.compile_reserve:
                run.note(
                    f"{pair} {name} batch {batch}: skipped, {run.left():.0f}s left < {a.compile_reserve}s"
                )
                continue
            prompts = run.prompts(vocab, batch, seed=batch)
            ids = torch.tensor(prompts, dtype=torch.long, device=run.device)  # (B, P)
            proc = LogitsProcessorList([AgreeProcessor(vocab, 0.0)])

            def go(n: int, model=model, ids=ids, proc=proc) -> None:
                model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                    do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=proc,
                    cache_implementation="static",
                )  # fmt: skip

            try:
                first, _ = run.timed(lambda: go(a.new_tokens))  # compiles (and captures graphs)
                second, _ = run.timed(lambda: go(a.new_tokens))  # may still capture for new shapes
                walls = [run.timed(lambda: go(a.new_tokens))[0] for _ in range(a.reps)]
            except Exception as exc:
                run.error(f"{pair} {name} batch {batch}", exc)
                comp[f"{key}_b{batch}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                run.save()
                continue
            med = statistics.median(walls)
            ntok = batch * a.new_tokens
            comp[f"{key}_b{batch}"] = {"first_call_s": first, "second_call_s": second, "steady_s": med}
            cost = costs[0] if key == "slm" else costs[1]
            bw = plain_bytes(cost, batch, a.prompt_len, a.new_tokens) / ntok / GPU_BANDWIDTH[a.gpu]
            row = {
                "pair": pair, "batch": batch, "variant": name, "method": "hf_generate_static_compiled",
                "model": key, "f": 0.0 if key == "slm" else 1.0, "llm_fraction": 0.0 if key == "slm" else 1.0,
                "new_tokens": a.new_tokens, "prompt_len": a.prompt_len, "reps_s": [round(w, 5) for w in walls],
                "wall_s": med, "ms_per_token": 1e3 * med / ntok, "ms_per_row_token": 1e3 * med / a.new_tokens,
                "tokens_per_s": ntok / med, "compile_first_call_s": first, "bw_limit_ms_per_token": 1e3 * bw,
                "ratio_to_bw": med / ntok / bw, "llm_calls_per_step": 0.0 if key == "slm" else 1.0,
            }  # fmt: skip
            run.report["rows"].append(row)
            run.save()
            run.print_rows([row])
