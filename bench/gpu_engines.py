"""The variants measured at every batch size: transformers ``generate`` with one model (``hf_slm``/``hf_llm``), our
engine with one model alone (``engine_slm``/``engine_llm``), routed by a random router (``routed_f{p}``, and
``routed_always_llm`` at batch 1), and routed with shared LLM calls (``shared_f{p}``, batch > 1); the same engine
variants before the lean forward and fixed-shape steps under ``v0_`` names. Timed interleaved
after a warm-up, one row each with its time per token, LLM calls, bytes moved and ratios to the bandwidth limit and
to the ideal ``f * t_LLM + t_SLM``."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_assisted import AgreeProcessor
from bench.gpu_pairs import BuiltPair
from bench.gpu_run import BenchRun
from bench.gpu_timing import plain_bytes
from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter
from citer.decoding.cost import GPU_BANDWIDTH
from citer.decoding.engine import RoutedEngine
from citer.decoding.lean import set_forward_path


def shared_min_rows(args: argparse.Namespace, batch: int) -> int:
    """``llm_min_rows`` of the shared variants at ``batch``: ``--min-rows``, or max(2, batch // 4) when it is 0."""
    m = args.min_rows if args.min_rows > 0 else max(2, batch // 4)
    return max(1, min(m, batch))


def engines(run: BenchRun, models: BuiltPair, batch: int) -> dict[str, tuple[RoutedEngine, float | None]]:
    """The engine variants at ``batch``: name -> (engine, router p), p = 1.0 for the LLM alone.

    Unprefixed names are the engine as it now runs: the lean forward with fixed-shape steps (``--static-steps``,
    CUDA graphs by default on a GPU). ``v0_`` names are the engine before it (HF modules, ragged eager calls), timed
    in the same run for the comparison; :func:`forward_for` pins their forward before each call."""
    slm, llm, vocab = models.slm, models.llm, models.vocab
    a = run.args
    out: dict[str, tuple[RoutedEngine, float | None]] = {}
    for prefix, steps in (("", a.static_steps), ("v0_", None)):
        if prefix and not a.v0:
            continue
        kw0 = {"vocab_size": vocab, "gpu": a.gpu, "static_steps": steps}
        out[f"{prefix}engine_slm"] = (RoutedEngine(slm, None, AlwaysSLM(), **kw0), 0.0)
        out[f"{prefix}engine_llm"] = (RoutedEngine(llm, None, AlwaysSLM(), **kw0), 1.0)
        for p in a.fractions:
            out[f"{prefix}routed_f{p:g}"] = (
                RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5, **kw0),
                p,
            )
        if batch == 1:
            out[f"{prefix}routed_always_llm"] = (RoutedEngine(slm, llm, AlwaysLLM(), **kw0), 1.0)
        if batch > 1 and run.has_shared:
            kw = {"llm_min_rows": shared_min_rows(a, batch), "llm_max_wait_steps": a.max_wait_steps}
            for p in a.fractions:
                out[f"{prefix}shared_f{p:g}"] = (
                    RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5, **kw0, **kw),
                    p,
                )
        # Overlapped steps (the SLM's call queued while the catch-up is in flight), the engine as it now runs only.
        if not prefix and batch > 1 and run.has_overlap:
            shared = [("", {})] + ([("shared_", kw)] if run.has_shared else [])
            for p in a.overlap_fractions:
                for name, extra in shared:
                    out[f"overlap_{name}f{p:g}"] = (
                        RoutedEngine(
                            slm, llm, RandomRouter(p, seed=0), tau=0.5, overlap=True, **kw0, **extra
                        ),
                        p,
                    )
    return out


def forward_for(name: str, e: RoutedEngine) -> None:
    """Pin the HF forward for a ``v0_`` variant, let the lean one run otherwise (models are shared by variants)."""
    for m in (e.slm, e.llm):
        if m is not None:
            set_forward_path(m, "hf" if name.startswith("v0_") else "auto")


def measure_batch(
    run: BenchRun, models: BuiltPair, prompts: list[list[int]], ids: torch.Tensor
) -> tuple[list[dict], dict[str, float]]:
    """Rows of the HF and engine variants on ``prompts`` (``ids``: the same as a (B, P) tensor), and seconds per
    token of each variant measured, by name."""
    pair, slm, llm, costs, vocab = models.name, models.slm, models.llm, models.costs, models.vocab
    a = run.args
    batch = len(prompts)
    n_new, plen = a.new_tokens, a.prompt_len
    cut = AgreeProcessor(vocab, 0.0)
    from transformers import LogitsProcessorList

    def hf(model: Any, **extra: Any) -> Callable[[int], dict]:
        def go(n: int) -> dict:
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None,
                logits_processor=LogitsProcessorList([cut]), **extra,
            )  # fmt: skip
            return {}

        return go

    def eng(name: str, e: RoutedEngine) -> Callable[[int], dict]:
        def go(n: int) -> dict:
            forward_for(name, e)
            return {"stats": e.generate_batch(prompts, n).batch, "forward": e.forward_paths}

        return go

    variants: dict[str, tuple[Callable[[int], dict], dict]] = {
        "hf_slm": (hf(slm), {"method": "hf_generate", "model": "slm", "f": 0.0}),
        "hf_llm": (hf(llm), {"method": "hf_generate", "model": "llm", "f": 1.0}),
    }
    for name, (e, p) in engines(run, models, batch).items():
        meta = {"method": name.rsplit("_f", 1)[0] if "_f" in name else name, "f": p,
                "static_steps": e.static_steps, "overlap": getattr(e, "overlap", False)}  # fmt: skip
        if "shared" in name:
            meta.update(llm_min_rows=e.llm_min_rows, llm_max_wait_steps=e.llm_max_wait_steps)
        variants[name] = (eng(name, e), meta)

    # Warm-up (kernels, allocator, cuBLAS handles), then interleaved reps: drift biases every variant alike.
    for name, (fn, _) in variants.items():
        try:
            run.timed(lambda fn=fn: fn(a.warmup_tokens or n_new))
        except Exception as exc:  # a broken variant is reported, the others still run
            run.error(f"{pair} batch {batch} {name} warm-up", exc)
    walls: dict[str, list[float]] = {k: [] for k in variants}
    last: dict[str, dict] = {}
    for rep in range(a.reps):
        for name, (fn, _) in variants.items():
            if run.left() < 15 and walls[name]:
                continue
            try:
                sec, info = run.timed(lambda fn=fn: fn(n_new))
            except Exception as exc:
                run.error(f"{pair} batch {batch} {name} rep {rep}", exc)
                continue
            walls[name].append(sec)
            last[name] = info
    med = {k: statistics.median(v) for k, v in walls.items() if v}
    ntok = batch * n_new
    t_tok = {k: v / ntok for k, v in med.items()}
    rows = []
    for name, (_, meta) in variants.items():
        if name not in med:
            continue
        row = {
            "pair": pair,
            "batch": batch,
            "variant": name,
            **meta,
            "new_tokens": n_new,
            "prompt_len": plen,
        }
        row["reps_s"] = [round(w, 5) for w in walls[name]]
        row["wall_s"] = med[name]
        row["min_ms_per_token"] = 1e3 * min(walls[name]) / ntok
        row["ms_per_token"] = 1e3 * t_tok[name]
        row["ms_per_row_token"] = 1e3 * med[name] / n_new
        row["tokens_per_s"] = ntok / med[name]
        st = last[name].get("stats")
        if "forward" in last[name]:
            row["forward"] = last[name]["forward"]
        if st is not None:
            steps = getattr(st, "decode_steps", 0) or None
            row["decode_steps"] = steps
            if name.endswith("engine_llm"):  # the LLM decoding alone, as the engine's only model
                f = 1.0
                row["llm_calls"] = st.slm_calls
                row["llm_calls_per_token"] = st.slm_calls / st.new_tokens
                row["llm_calls_per_step"] = st.slm_calls / (steps or n_new)
            else:
                f = st.llm_fraction
                row["llm_calls"] = st.llm_calls
                row["llm_calls_per_token"] = st.llm_calls_per_token
                row["llm_calls_per_step"] = st.llm_calls / (steps or n_new)
            row["llm_fraction"] = f
            row["wait_row_steps"] = getattr(st, "wait_row_steps", None)
            row["overlapped_steps"] = getattr(st, "overlapped_steps", None)
            row["llm_catchup_tokens"] = st.llm_catchup_tokens
            bytes_tok = st.bytes_moved / st.new_tokens
            pre = "v0_" if name.startswith("v0_") else ""
            alone = (f"{pre}engine_slm", f"{pre}engine_llm")
            if name not in alone and alone[0] in t_tok and alone[1] in t_tok:
                ideal = f * t_tok[alone[1]] + t_tok[alone[0]]
                row["ideal_ms_per_token"] = 1e3 * ideal
                row["ratio_to_ideal"] = t_tok[name] / ideal
        else:
            cost = costs[0] if meta["model"] == "slm" else costs[1]
            bytes_tok = plain_bytes(cost, batch, plen, n_new) / ntok
            row["llm_fraction"] = meta["f"]
            row["llm_calls_per_step"] = 0.0 if meta["model"] == "slm" else 1.0
        bw = bytes_tok / GPU_BANDWIDTH[a.gpu]
        row["bytes_per_token"] = bytes_tok
        row["bw_limit_ms_per_token"] = 1e3 * bw
        row["ratio_to_bw"] = t_tok[name] / bw
        rows.append(row)
    return rows, t_tok
