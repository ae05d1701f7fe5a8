"""Where routing's ceiling falls with the batch, measured on this machine: ``python bench/roofline.py``.

CITER's LLM must read every token of a row before it writes one (its prompt at the row's first routed token, then a
catch-up over the SLM's tokens since its last call), so a routed pair spends, beyond the SLM's decoding, the LLM's
compute for every prompt and generated token. LLM-only decoding spends the same prompt compute plus one weight pass
per step. At batch 1 the passes dominate and routing saves most of them; as the batch grows a step's weight pass is
shared by more rows, the prompts' compute grows with the batch, and the ratio that routing can reach falls.

Per batch, one process, the engines built as ``citer route`` builds them (the ``engine:`` block of ``params.yaml``,
no fixed-shape steps) at the speed bench's real shapes with random weights (``bench/speed_report.py``):

- ``llm_s`` / ``slm_s`` / ``routed_s``: ``generate_batch(prompts, n)`` wall seconds (routed: a random router sending
  a fraction ``f`` of the tokens to the LLM; the median of ``--reps`` after one warm-up, the full runs of every
  engine and variant timed in turn, so a host that slows down for a while slows them all);
- ``llm_prefill_s`` / ``slm_prefill_s``: ``generate_batch(prompts, 1)``: the prompts' prefill and one step;
- ``llm_tokens_per_s_prefill``: b x prompt / ``llm_prefill_s``: the LLM's rate over many tokens at once, the fastest
  it reads tokens on this machine (catch-ups read fewer at a time, so no faster);
- ``ceiling``: ``llm_s`` / (``slm_s`` + (prompt + catch-up tokens the routed run's LLM read) /
  ``llm_tokens_per_s_prefill``): the most a routing that sends these tokens to the LLM can gain at this batch,
  prompt and length, however it schedules its calls (its decoding is the SLM's, the LLM's part only the compute
  it cannot skip);
- ``decode_ceiling``: the same without either side's prompt, what long generations approach;
- ``llm_row_step_s``: one row's LLM decode step alone (``generate_batch`` of one prompt, 8 tokens less 1): a weight
  pass, what every LLM call pays however few tokens it reads;
- ``ceiling_at_calls``: ``ceiling``'s denominator plus (``routed_llm_calls`` - 1) x ``llm_row_step_s``: the most
  routing can gain making as many LLM calls as the routed run made, each a weight pass beside its tokens' compute
  (the prompt rate holds one pass already: ``ceiling`` is one call reading every token). Where it is below 1 only
  fewer calls can win, and fewer calls make routed rows wait;
- ``measured``: ``llm_s`` / ``routed_s``;
- ``stream_measured``: ``stream_llm_s`` / ``stream_routed_s``, ``--stream`` x batch prompts decoded through
  ``max_rows`` = batch, as ``citer route`` decodes a dataset (continuous batching: a row that finishes, or waits for
  the LLM, leaves its place in the SLM's batch to a queued one); ``stream_routed_llm_calls`` its LLM calls.

Writes ``reports/bench_roofline.json`` (``--out``), stamped in ``reports/provenance.json``; docs/results.md renders it
(``citer report docs``). Say whether the machine was quiet: ``others_cpu_share`` is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from citer.ops.openmp import set_wait_env, wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import torch  # noqa: E402
import yaml  # noqa: E402
from speed_report import build_pair, cpu_precision, cpu_times, others_cpu_share, write_report  # noqa: E402

from citer.config import load_params  # noqa: E402
from citer.config.serving import EngineParams  # noqa: E402
from citer.decoding.baselines import AlwaysSLM, RandomRouter  # noqa: E402
from citer.serving.champion import route_engine  # noqa: E402
from citer.tracking.provenance import cpu_kind  # noqa: E402


def engine_block(path: Path) -> EngineParams:
    """The ``engine:`` block of ``path`` (a ``params.yaml``), validated as ``citer route`` reads it."""
    return load_params(path).engine


def timed(fn: Any, reps: int) -> tuple[float, Any]:
    """The median wall seconds of ``reps`` calls after one warm-up, and the last call's result."""
    return timed_in_turn({"fn": fn}, reps)["fn"]


def timed_in_turn(fns: dict[str, Any], reps: int) -> dict[str, tuple[float, Any]]:
    """Per name, the median wall seconds of ``reps`` calls and the last call's result, the functions called in turn
    (each warmed up once first): a host that slows down for a while slows every one of them, not the one timed then,
    so the ratios between them hold (this machine's speed drifts by tens of percent within minutes)."""
    for fn in fns.values():
        fn()
    secs: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, Any] = {}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            outs[k] = fn()
            secs[k].append(time.perf_counter() - t)
    return {k: (statistics.median(secs[k]), outs[k]) for k in fns}


def engines(pair: Any, f: float, block: EngineParams) -> dict[str, Any]:
    """LLM alone, SLM alone and the routed pair (a random router sending a fraction ``f`` of tokens to the LLM),
    each built by :func:`~citer.serving.champion.route_engine` with the params' engine block."""
    v = pair.vocab
    return {
        "llm": route_engine(pair.llm, None, AlwaysSLM(), 0.5, block, vocab_size=v),
        "slm": route_engine(pair.slm, None, AlwaysSLM(), 0.5, block, vocab_size=v),
        "routed": route_engine(pair.slm, pair.llm, RandomRouter(f, seed=0), 0.5, block, vocab_size=v),
    }


def parse_variants(text: str) -> dict[str, dict[str, Any]]:
    """``"llm_prefill=admit;llm_schedule=measured,llm_prefill=admit"`` -> {name: engine-block overrides}: other
    engine settings to time the routed pair with, beside the params' own."""
    out: dict[str, dict[str, Any]] = {}
    for spec in (v.strip() for v in text.split(";")):
        if spec:
            pairs = [kv.split("=", 1) for kv in spec.split(",")]
            out[spec] = {k.strip(): yaml.safe_load(v) for k, v in pairs}
    return out


def measure_batch(pair: Any, batch: int, prompt_len: int, new: int, f: float, reps: int,
                  block: EngineParams, variants: dict[str, dict[str, Any]] | None = None,
                  stream: int = 0) -> dict[str, Any]:  # fmt: skip
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, pair.vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    # As citer route runs a dataset: stream x batch prompts through max_rows = batch (continuous batching).
    many = [torch.randint(3, pair.vocab, (prompt_len,), generator=g).tolist() for _ in range(stream * batch)]
    built = engines(pair, f, block)
    row: dict[str, Any] = {"batch": batch}
    others = {
        name: engines(pair, f, EngineParams.model_validate(block.model_dump() | over))["routed"]
        for name, over in (variants or {}).items()
    }
    # Every full run in turn (LLM, SLM, routed, the variants), so the host's drift reaches them all alike.
    runs = {name: built[name] for name in ("llm", "slm", "routed")} | {
        f"variant {k}": e for k, e in others.items()
    }
    timed_runs = {k: (lambda e=e: e.generate_batch(prompts, new)) for k, e in runs.items()}
    if many:
        for name in ("llm", "routed"):
            timed_runs[f"stream {name}"] = lambda e=built[name]: e.generate_batch(many, new, max_rows=batch)
    got = timed_in_turn(timed_runs, reps)
    for name in ("llm", "slm"):
        row[f"{name}_s"] = got[name][0]
        row[f"{name}_prefill_s"], _ = timed(lambda e=built[name]: e.generate_batch(prompts, 1), reps)
    row["routed_s"], out = got["routed"]
    stats = out.batch
    row["routed_llm_fraction"] = stats.llm_fraction
    row["routed_llm_calls_per_step"] = stats.llm_calls_per_step
    row["routed_llm_prompt_tokens"] = stats.llm_prompt_tokens
    row["routed_llm_catchup_tokens"] = stats.llm_catchup_tokens
    row["routed_llm_calls"] = stats.llm_calls
    one = prompts[:1]
    whole, _ = timed(lambda: built["llm"].generate_batch(one, 8), reps)
    first, _ = timed(lambda: built["llm"].generate_batch(one, 1), reps)
    row["llm_row_step_s"] = (whole - first) / 7
    rate = batch * prompt_len / row["llm_prefill_s"]
    row["llm_tokens_per_s_prefill"] = rate
    # The LLM's compute over the tokens this routing made it read, at its fastest rate.
    prompt_s, catch_up_s = stats.llm_prompt_tokens / rate, stats.llm_catchup_tokens / rate
    row["llm_step_s"] = (row["llm_s"] - row["llm_prefill_s"]) / max(new - 1, 1)
    row["slm_step_s"] = (row["slm_s"] - row["slm_prefill_s"]) / max(new - 1, 1)
    row["ceiling"] = row["llm_s"] / (row["slm_s"] + prompt_s + catch_up_s)
    row["ceiling_at_calls"] = row["llm_s"] / (
        row["slm_s"] + prompt_s + catch_up_s + max(stats.llm_calls - 1, 0) * row["llm_row_step_s"]
    )
    row["decode_ceiling"] = (row["llm_s"] - row["llm_prefill_s"]) / (
        row["slm_s"] - row["slm_prefill_s"] + catch_up_s
    )
    row["llm_prefill_share"] = row["llm_prefill_s"] / row["llm_s"]
    row["measured"] = row["llm_s"] / row["routed_s"]
    if many:
        row["stream_rows"] = len(many)
        row["stream_llm_s"], _ = got["stream llm"]
        row["stream_routed_s"], st = got["stream routed"]
        row["stream_measured"] = row["stream_llm_s"] / row["stream_routed_s"]
        row["stream_routed_llm_calls"] = st.batch.llm_calls
    row["variants"] = {}
    for name in others:
        secs, alt = got[f"variant {name}"]
        # Rows whose tokens equal the params' engine's: all in float32; in bf16 another call shape may round a near
        # tie of these random weights otherwise (tests/decoding/test_call_rule.py holds float32 to equality).
        same = sum(a == b for a, b in zip(alt.tokens, out.tokens, strict=True)) / batch
        row["variants"][name] = {"routed_s": secs, "measured": row["llm_s"] / secs, "same_rows": same,
                                 "llm_calls_per_step": alt.batch.llm_calls_per_step}  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2")
    ap.add_argument("--dtype", default=cpu_precision(), choices=["bf16", "fp32"],
                    help="default: the CPU's winning precision (bf16 with bf16 products, else fp32)")  # fmt: skip
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_roofline.json"))
    ap.add_argument("--stream", type=int, default=4,
                    help="also time stream x batch prompts through max_rows = batch, as citer route runs a dataset "
                         "(0: not)")  # fmt: skip
    ap.add_argument("--variants", default="",
                    help="other engine settings to time routed with, ';'-separated, each 'key=value,...'")  # fmt: skip
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    start, t0 = cpu_times(), time.perf_counter()
    block = engine_block(Path(a.params))
    pair = build_pair(a.pair, "cpu", a.dtype)
    rows = []
    for b in [int(x) for x in a.batches.split(",") if x]:
        rows.append(measure_batch(pair, b, a.prompt_len, a.new_tokens, a.fraction, a.reps, block,
                                  parse_variants(a.variants), a.stream))  # fmt: skip
        r = rows[-1]
        print(f"b{b}: llm {r['llm_s']:.2f} s (prefill {r['llm_prefill_share']:.0%}), slm {r['slm_s']:.2f} s, routed "
              f"{r['routed_s']:.2f} s: measured {r['measured']:.2f}x, ceiling {r['ceiling']:.2f}x, at its "
              f"{r['routed_llm_calls']} LLM calls {r['ceiling_at_calls']:.2f}x, decode-only ceiling "
              f"{r['decode_ceiling']:.2f}x", flush=True)  # fmt: skip
        if "stream_measured" in r:
            print(f"    {r['stream_rows']} prompts through max_rows {b}: llm {r['stream_llm_s']:.2f} s, routed "
                  f"{r['stream_routed_s']:.2f} s: {r['stream_measured']:.2f}x", flush=True)  # fmt: skip
        for name, v in r["variants"].items():
            print(
                f"    {name}: routed {v['routed_s']:.2f} s, {v['measured']:.2f}x, same rows {v['same_rows']:.0%}",
                flush=True,
            )
    report = {
        "bench": "roofline",
        "cpu": cpu_kind(),
        "threads": torch.get_num_threads(),
        "openmp": wait_env(),
        "torch": torch.__version__,
        "pair": a.pair,
        "dtype": a.dtype,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "fraction": a.fraction,
        "reps": a.reps,
        "engine": block.model_dump(),
        "rows": rows,
        "others_cpu_share": others_cpu_share(start, cpu_times()),
    }
    write_report(a.out, report, "roofline", a, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
