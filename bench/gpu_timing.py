"""How ``bench/gpu.py`` measures and what it derives: device syncs around timed calls, the host's dispatch speed,
forward calls and bytes counted per model, bytes of plain decoding as the engine's meter counts them, and the
per-token times, ratios to the bandwidth limit and to the ideal, and targets derived from the raw reps."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from citer.decoding.cost import ModelCost


# ----------------------------------------------------------------------------------------------------------- timing
def sync(device: str) -> None:
    """Waits for the device's queued kernels: CUDA calls return before the work is done, so a timing without it
    measures only the launches."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_bytes(cost: ModelCost, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes of plain decoding as :class:`citer.decoding.cost.CostMeter` counts them: one prefill call, then
    ``new_tokens - 1`` one-token calls, each reading the weights once and every row's KV."""
    total = cost.weight_bytes + batch * cost.kv_bytes_per_token * 2 * prompt_len
    for i in range(1, new_tokens):
        total += cost.weight_bytes + batch * cost.kv_bytes_per_token * (prompt_len + i + 1)
    return float(total)


@contextlib.contextmanager
def call_counter(
    slm: Any, llm: Any, costs: tuple[ModelCost, ModelCost], batch: int
) -> Iterator[dict[str, float]]:
    """Counts every forward call of both models and the bytes it moves (weights once, KV of every row)."""
    tally: dict[str, float] = {"slm_calls": 0, "llm_calls": 0, "slm_tokens": 0, "llm_tokens": 0, "bytes": 0.0}

    def hook(key: str, cost: ModelCost):
        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = kwargs.get("past_key_values")
            new = int(ids.shape[1])
            seen = int(past.get_seq_length()) if past is not None else 0
            tally[f"{key}_calls"] += 1
            tally[f"{key}_tokens"] += new
            tally["bytes"] += cost.weight_bytes + batch * cost.kv_bytes_per_token * (seen + 2 * new)

        return pre

    handles = [
        slm.register_forward_pre_hook(hook("slm", costs[0]), with_kwargs=True),
        llm.register_forward_pre_hook(hook("llm", costs[1]), with_kwargs=True),
    ]
    try:
        yield tally
    finally:
        for h in handles:
            h.remove()


def host_probe(device: str) -> dict[str, Any]:
    """How fast this host issues work: Python loop, eager op dispatch and kernel launch (in µs per op). Decoding at
    small batch is bound by these on most hosts, so they say how far a timing here carries to another machine."""
    out: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["cpu_model"] = line.split(":", 1)[1].strip()
                break
    t = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i
    out["python_loop_ns_per_iter"] = (time.perf_counter() - t) / 200_000 * 1e9
    for where in ["cpu", *([device] if device != "cpu" else [])]:
        x = torch.zeros(16, device=where)
        for _ in range(200):
            x.add_(1.0)
        sync(where)
        t = time.perf_counter()
        for _ in range(5000):
            x.add_(1.0)
        sync(where)
        out[f"eager_add_us_per_op_{where}"] = (time.perf_counter() - t) / 5000 * 1e6
    return out


# ---------------------------------------------------------------------------------------------------- derived
def derive_timings(report: dict[str, Any], stat: str = "median") -> None:
    """(Re)compute every timing field of ``report["rows"]`` from the raw ``reps_s`` with ``stat`` (median or min):
    per-token times, ratios to the bandwidth limit and to the ideal, and assisted vs routed at equal LLM calls."""
    pick = min if stat == "min" else statistics.median
    rows = report["rows"]
    for r in rows:
        reps = r.get("reps_s")
        if not reps:
            continue
        w = pick(reps)
        ntok = r["batch"] * r["new_tokens"]
        r["wall_s"] = w
        r["ms_per_token"] = 1e3 * w / ntok
        r["min_ms_per_token"] = 1e3 * min(reps) / ntok
        r["ms_per_row_token"] = 1e3 * w / r["new_tokens"]
        r["tokens_per_s"] = ntok / w
        if r.get("bw_limit_ms_per_token"):
            r["ratio_to_bw"] = r["ms_per_token"] / r["bw_limit_ms_per_token"]
    idx = {(r["pair"], r["batch"], r["variant"]): r for r in rows}
    for r in rows:
        pre = "v0_" if r["variant"].startswith("v0_") else ""  # a v0_ row's ideal is of the v0_ engine alone
        sl, ll = (
            idx.get((r["pair"], r["batch"], f"{pre}engine_slm")),
            idx.get((r["pair"], r["batch"], f"{pre}engine_llm")),
        )
        if sl is None or ll is None:
            continue
        if (
            r["variant"].removeprefix(pre).startswith(("routed", "shared", "overlap"))
            and r.get("llm_fraction") is not None
        ):
            ideal = r["llm_fraction"] * ll["ms_per_token"] + sl["ms_per_token"]
            r["ideal_ms_per_token"] = ideal
            r["ratio_to_ideal"] = r["ms_per_token"] / ideal
        elif r["variant"].startswith("assisted"):
            c = r["llm_calls_per_token"]
            r["routed_ideal_ms_at_same_llm_calls"] = c * ll["ms_per_token"] + sl["ms_per_token"]
            same = [x for x in rows if (x["pair"], x["batch"]) == (r["pair"], r["batch"])]
            curve = sorted(
                (x["llm_calls_per_token"], x["ms_per_token"])
                for x in same
                if x["variant"].startswith("routed") and "llm_calls_per_token" in x
            )
            if curve:
                y = interpolate(curve, c)
                r["routed_ms_at_same_llm_calls"] = y
                r["assisted_over_routed"] = r["ms_per_token"] / y
    report["stat"] = stat


# The LLM-only decoders a routed row is compared with: HF eager and compiled, our engine now and before.
LLM_ONLY = ("hf_llm", "hf_llm_static_compiled", "engine_llm", "v0_engine_llm")


# The routed f=0.1 decoders a target takes the best of: plain, shared LLM calls, overlapped, both.
ROUTED_F01 = ("routed_f0.1", "shared_f0.1", "overlap_f0.1", "overlap_shared_f0.1")


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, per pair, from the derived rows."""
    rows = report["rows"]
    out: dict[str, Any] = {}

    def get(pair: str, batch: int, variant: str) -> dict | None:
        return next(
            (r for r in rows if (r["pair"], r["batch"], r["variant"]) == (pair, batch, variant)), None
        )

    for pair in report["pairs"]:
        s: dict[str, Any] = {}
        r1 = [
            r for r in rows if r["pair"] == pair and r["batch"] == 1 and r["variant"].startswith("routed_f")
        ]
        if r1:
            worst = max(r["ratio_to_ideal"] for r in r1 if "ratio_to_ideal" in r)
            s["routed_b1_worst_ratio_to_ideal"] = worst
            s["routed_b1_within_1.15x_ideal"] = worst <= 1.15
        big = max((r["batch"] for r in rows if r["pair"] == pair), default=None)
        sh = get(pair, big, "shared_f0.1") if big else None
        if sh is not None:
            llm_best = max(
                (r["tokens_per_s"] for r in rows if r["pair"] == pair and r["batch"] == big
                 and r.get("f") == 1.0 and r["variant"] in ("hf_llm", "engine_llm")),
                default=None,
            )  # fmt: skip
            routed = get(pair, big, "routed_f0.1")
            s[f"b{big}_shared_f0.1_tokens_per_s"] = sh["tokens_per_s"]
            s[f"b{big}_routed_f0.1_tokens_per_s"] = routed["tokens_per_s"] if routed else None
            s[f"b{big}_llm_only_best_eager_tokens_per_s"] = llm_best
            if llm_best:
                s[f"b{big}_shared_f0.1_beats_llm_only"] = sh["tokens_per_s"] > llm_best
            comp = get(pair, big, "hf_llm_static_compiled")
            if comp is not None:
                s[f"b{big}_llm_only_compiled_tokens_per_s"] = comp["tokens_per_s"]
        # Issue #22: routed f=0.1 (shared calls allowed) over the best LLM-only decoder of the same run, per batch.
        for b in sorted({r["batch"] for r in rows if r["pair"] == pair}):
            at = [r for r in rows if r["pair"] == pair and r["batch"] == b]
            llm_only = [r for r in at if r.get("f") == 1.0 and r["variant"] in LLM_ONLY]
            routed = [r for r in at if r["variant"] in ROUTED_F01]
            if llm_only and routed:
                best = max(llm_only, key=lambda r: r["tokens_per_s"])
                top = max(routed, key=lambda r: r["tokens_per_s"])
                s[f"b{b}_routed_f0.1_over_best_llm_only"] = top["tokens_per_s"] / best["tokens_per_s"]
                s[f"b{b}_best_llm_only"] = best["variant"]
                s[f"b{b}_best_routed_f0.1"] = top["variant"]
            eng = next((r for r in at if r["variant"] == "engine_llm" and "ratio_to_bw" in r), None)
            if eng is not None:
                s[f"b{b}_engine_llm_ratio_to_bw"] = eng["ratio_to_bw"]
        asst = [r for r in rows if r["pair"] == pair and r["variant"].startswith("assisted")]
        if asst:
            s["assisted_over_routed_at_same_llm_calls"] = {
                r["variant"]: r.get("assisted_over_routed") for r in asst
            }
            s["routed_beats_assisted_at_equal_llm_calls"] = all(
                (r.get("assisted_over_routed") or 0) > 1.0 for r in asst
            )
        out[pair] = s
    return out


def routed_curve(rows: list[dict]) -> list[tuple[float, float]]:
    """(LLM calls per token, seconds per token) of the routed variants among ``rows`` (one pair, one batch), sorted."""
    pts = [
        (r["llm_calls_per_token"], r["ms_per_token"] / 1e3)
        for r in rows
        if r["variant"].startswith("routed") and "llm_calls_per_token" in r
    ]
    return sorted(pts)


def interpolate(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through pts (sorted by x); linear extrapolation from the end segments."""
    if len(pts) == 1:
        return pts[0][1]
    i = 0
    while i < len(pts) - 2 and x > pts[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
