"""Serving throughput and latency of `citer serve` under concurrent clients: ``python bench/serving.py``.

The real app on 127.0.0.1 (uvicorn in this process) serves the embedded architectures with random weights over a
character tokenizer (throughput does not depend on what the weights say) or ``--models DIR`` (``slm``/``llm``). The
clients stream from a child process (this file with ``--load``: no heavy import, the server's interpreter lock stays
the server's; aiohttp, whose C parser keeps up with 32 streams). Servers: ``continuous`` (the default),
``continuous_shared`` (shared LLM calls), ``one_at_a_time`` (``continuous_batching=False``), ``llm_only``,
``continuous_verified`` (verified routing: a token streams once no check can take it back, so its time to first
token shows what verification adds; random weights disagree often, a pessimistic case), each at 1, 8 and 32 clients.

Per level: tokens/s, p50/p99 latency, p50 time to first token and its share of the answer's time, requests lost, and
answers that differ from the request served alone. Each level is measured server after server, in alternating order
over ``--rounds`` rounds, each server's best round kept (every round under ``rounds``), so the ratios are taken under
the same load. Writes ``reports/bench_serving.json`` atomically. ``--quick``: a smoke run (docs/results.md#serving).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "citer-bench"


async def _client(base: str, bodies: list[dict], out: list[dict]) -> None:
    """One client: its requests one after another, each streamed; the time to the first text and to the end."""
    import aiohttp

    async with aiohttp.ClientSession(base_url=base, timeout=aiohttp.ClientTimeout(total=600)) as c:
        for body in bodies:
            t0 = time.perf_counter()
            first, text, usage = None, "", None
            async with c.post("/v1/completions", json=body) as r:
                async for raw in r.content:
                    line = raw.decode().rstrip("\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    usage = ev.get("usage") or usage
                    for ch in ev.get("choices", []):
                        if ch.get("text"):
                            first = first or time.perf_counter() - t0
                            text += ch["text"]
            out.append(dict(prompt=body["prompt"], status=r.status, text=text, ttft=first,
                            latency=time.perf_counter() - t0, tokens=(usage or {}).get("completion_tokens", 0)))  # fmt: skip


def _load_here(spec: dict) -> None:
    """The child process: every client at once; prints the results and the wall time as one JSON line."""
    clients, prompts = spec["clients"], spec["prompts"]
    bodies = [dict(model=MODEL, prompt=prompts[i % len(prompts)], max_tokens=spec["max_tokens"], stream=True,
                   stream_options={"include_usage": True}) for i in range(clients * spec["per_client"])]  # fmt: skip
    out: list[dict] = []

    async def run() -> None:
        await asyncio.gather(*(_client(spec["base"], bodies[k::clients], out) for k in range(clients)))

    t0 = time.perf_counter()
    asyncio.run(run())
    print(json.dumps({"results": out, "wall_s": time.perf_counter() - t0}))


def load(
    base: str, prompts: list[str], clients: int, per_client: int, max_tokens: int
) -> tuple[list[dict], float]:
    """Run the clients in a child process; returns their results and the wall time."""
    spec = dict(base=base, prompts=prompts, clients=clients, per_client=per_client, max_tokens=max_tokens)
    proc = subprocess.run([sys.executable, __file__, "--load", json.dumps(spec)], capture_output=True, text=True,
                          check=False, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["results"], out["wall_s"]


def char_tokenizer():
    """Printable ASCII, one token per character: every token streams at once (a byte-level BPE under random weights
    emits stray high bytes, and a piece ending inside a character is rightly held back, which hides the latency)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(i): i - 29 for i in range(32, 127)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def embedded_pair(models: str | None):
    """(slm, llm, tokenizer): a trained pair from ``models``, else the bootstrap architectures with random weights
    over a character tokenizer."""
    if models:
        from citer.models.loading import load_pair

        return load_pair(str(Path(models) / "slm"), str(Path(models) / "llm"), "float32", "cpu", False)
    from citer.config import BootstrapParams
    from citer.models.bootstrap import build_model

    bp, tok = BootstrapParams(), char_tokenizer()
    return build_model(bp.slm, tok, seed=1).eval(), build_model(bp.llm, tok, seed=2).eval(), tok


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def summarise(server: str, clients: int, res: list[dict], wall: float, alone: dict[str, str]) -> dict:
    ok = [r for r in res if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return dict(server=server, clients=clients, requests=len(res), lost=len(res) - len(ok),
                differ_from_alone=sum(r["text"] != alone[r["prompt"]] for r in ok if r["prompt"] in alone),
                completion_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, p50_latency_s=_pct(lat, 0.5),
                p99_latency_s=_pct(lat, 0.99), p50_ttft_s=statistics.median(ttft) if ttft else None,
                ttft_over_latency=statistics.median(r["ttft"] / r["latency"] for r in ok if r["ttft"])
                if ttft else None)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer requests and tokens")
    ap.add_argument("--models", help="a directory with slm/ and llm/ (default: random embedded pair)")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--llm-fraction", type=float, default=0.1, help="the random router's share of LLM tokens")
    ap.add_argument("--llm-min-rows", type=int, default=4, help="continuous_shared: engine.llm_min_rows")
    ap.add_argument("--llm-max-wait-steps", type=int, default=4, help="continuous_shared: llm_max_wait_steps")
    ap.add_argument("--verify-rho", type=float, default=1.0, help="continuous_verified: rho")
    ap.add_argument("--verify-window", type=int, default=4, help="continuous_verified: W")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level; each server's best is kept")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_serving.json"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from citer.decoding.baselines import AlwaysLLM, RandomRouter
    from citer.decoding.engine import RoutedEngine
    from citer.ops.io import write_json
    from citer.serving.local import serving_in_background
    from citer.serving.server import build_app
    from citer.tracking.provenance import stamp_bench

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    levels = [int(c) for c in args.clients.split(",")]
    per_client = {c: max(1, (8 if args.quick else 32) // c) for c in levels}  # >= 32 requests per level
    slm, llm, tok = embedded_pair(args.models)
    prompts = [f"Question: What is {a} + {3 * a % 17}?\nAnswer:" for a in range(40)]
    shared = dict(llm_min_rows=args.llm_min_rows, llm_max_wait_steps=args.llm_max_wait_steps)
    verify = dict(verify_rho=args.verify_rho, verify_window=args.verify_window, verify_final=True)

    def engine(router=None, **kw):
        router = router or RandomRouter(args.llm_fraction, seed=0)
        return RoutedEngine(slm, llm, router, eos_token_id=tok.eos_token_id, **kw)

    servers = {  # name: (engine, continuous batching)
        "continuous": (engine(), True),
        "continuous_shared": (engine(**shared), True),
        "one_at_a_time": (engine(), False),
        "llm_only": (engine(AlwaysLLM()), True),
        "continuous_verified": (engine(**verify), True),
    }
    # Every server runs at once (an idle one costs nothing); each level is measured server after server, in
    # alternating order over --rounds rounds, and each server's best round is kept: drifting load on a shared
    # machine then biases every server alike. Every round's headline numbers are kept too, so the spread is reported.
    best: dict[tuple[str, int], dict] = {}
    every: dict[tuple[str, int], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, (eng, continuous) in servers.items():
            app = build_app(eng, tok, model_name=MODEL, max_new_tokens=max_tokens, fmt="raw",
                            continuous_batching=continuous, max_batch_rows=64, max_queued_requests=256)  # fmt: skip
            bases[name] = stack.enter_context(serving_in_background(app))
            load(bases[name], prompts[:2], 1, 1, 2)  # warm-up
        # Each prompt served alone; verified answers differ from plain routing's by design: compared with their own.
        alone = {n: {r["prompt"]: r["text"] for r in load(bases[n], prompts, 1, len(prompts), max_tokens)[0]}
                 for n in ("continuous", "continuous_verified")}  # fmt: skip
        for rnd in range(args.rounds):
            for c in levels:
                for name in list(servers)[:: 1 if rnd % 2 == 0 else -1]:
                    res, wall = load(bases[name], prompts, c, per_client[c], max_tokens)
                    ref = {} if name == "llm_only" else alone.get(name, alone["continuous"])
                    r = summarise(name, c, res, wall, ref)
                    print(f"round {rnd} {name:<19} clients {c:>3}: {r['tokens_per_s']:8.1f} tok/s  p50 "
                          f"{r['p50_latency_s']:.3f} s  p99 {r['p99_latency_s']:.3f} s  ttft/latency "
                          f"{r['ttft_over_latency'] or float('nan'):.2f}  lost {r['lost']}  differ "
                          f"{r['differ_from_alone']}", flush=True)  # fmt: skip
                    every.setdefault((name, c), []).append(
                        {k: r[k] for k in ("tokens_per_s", "p50_latency_s", "ttft_over_latency")}
                    )
                    # losses and differences count over every round, not only the kept one
                    old = best.get((name, c))
                    if old is not None:
                        r["lost"] += old["lost"]
                        r["differ_from_alone"] += old["differ_from_alone"]
                        if r["tokens_per_s"] <= old["tokens_per_s"]:
                            r = old | {k: r[k] for k in ("lost", "differ_from_alone")}
                    best[name, c] = r
    rows = [best[name, c] | {"rounds": every[name, c]} for name in servers for c in levels]
    by = {(r["server"], r["clients"]): r for r in rows}
    ratios = {}
    for a, b, key in (("continuous_shared", "one_at_a_time", "tokens_per_s"),
                      ("continuous", "one_at_a_time", "tokens_per_s"), ("continuous", "llm_only", "tokens_per_s"),
                      ("continuous_verified", "continuous", "p50_ttft_s")):  # fmt: skip
        what = "_ttft" if key == "p50_ttft_s" else ""
        ratios |= {f"{a}{what}_vs_{b}_at_{c}": by[a, c][key] / by[b, c][key] for c in levels if by[b, c][key]}
    report = dict(verify=verify, pair=args.models or "embedded architectures, random weights",
                  llm_fraction=args.llm_fraction, shared=shared, max_tokens=max_tokens,
                  torch_threads=torch.get_num_threads(), rows=rows, ratios=ratios, rounds=args.rounds,
                  note="one run on a shared CPU; compare ratios, not absolute numbers; best of the rounds per server "
                  "and level")  # fmt: skip
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    write_json(args.out, report)
    stamp_bench(args.out, "serving", args, time.perf_counter() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        _load_here(json.loads(sys.argv[2]))
    else:
        raise SystemExit(main())
