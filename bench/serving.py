"""Serving throughput and latency of `citer serve` under concurrent clients: ``python bench/serving.py``.

The server is the real app on 127.0.0.1 (uvicorn in this process; the clients run in a child process,
``bench/http_load.py``, so they do not take the server's interpreter lock), the pair the pipeline's embedded architectures (random weights over a
character tokenizer: throughput does not depend on what the weights say) or ``--models DIR`` (a trained pair with
``slm``/``llm`` subdirectories). Four servers, each measured at 1, 8 and 32 concurrent clients, every client
streaming its requests one after another:

- ``continuous``: requests join the running batch (the default);
- ``continuous_shared``: the same with shared LLM calls (``engine.llm_min_rows``/``llm_max_wait_steps``, 4 and 4);
- ``one_at_a_time``: ``continuous_batching=False``, the old behaviour;
- ``llm_only``: continuous batching with every token routed to the LLM;
- ``continuous_verified``: continuous batching with verified routing (``--verify-rho``, ``--verify-window``, final
  check on): a token streams only once a check can no longer take it back, so its time to first token shows the
  latency verification adds (random weights disagree often, so this is a pessimistic case).

Per level: throughput (completion tokens/s), p50/p99 latency, p50 time to first token and its ratio to the full
answer's time, requests lost (not 200), and answers that differ from the same request served alone. The servers run
side by side and each level is measured server after server, in alternating order over ``--rounds`` rounds (each
server's best round kept, every round's headline numbers listed under ``rounds``), so ratios between servers are
taken under the same load. Writes ``reports/bench_serving.json`` atomically. ``--quick``: a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.http_load import MODEL, load  # noqa: E402
from citer.config import BootstrapParams  # noqa: E402
from citer.decoding.baselines import AlwaysLLM, RandomRouter  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.ops.io import write_json  # noqa: E402
from citer.serving.local import serving_in_background  # noqa: E402
from citer.serving.server import build_app  # noqa: E402
from citer.tracking.provenance import stamp_bench  # noqa: E402


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
    ap.add_argument(
        "--models", default=None, help="a directory with slm/ and llm/ (default: random embedded pair)"
    )
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--llm-fraction", type=float, default=0.1, help="the random router's share of LLM tokens")
    ap.add_argument("--llm-min-rows", type=int, default=4, help="continuous_shared: engine.llm_min_rows")
    ap.add_argument(
        "--llm-max-wait-steps", type=int, default=4, help="continuous_shared: engine.llm_max_wait_steps"
    )
    ap.add_argument("--verify-rho", type=float, default=1.0, help="continuous_verified: rho")
    ap.add_argument("--verify-window", type=int, default=4, help="continuous_verified: W")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level; each server's best is kept")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_serving.json"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    levels = [int(c) for c in args.clients.split(",")]
    per_client = {c: max(1, (8 if args.quick else 32) // c) for c in levels}  # >= 32 requests per level
    slm, llm, tok = embedded_pair(args.models)
    prompts = [f"Question: What is {a} + {3 * a % 17}?\nAnswer:" for a in range(40)]
    eos = tok.eos_token_id
    shared = dict(llm_min_rows=args.llm_min_rows, llm_max_wait_steps=args.llm_max_wait_steps)
    verify = dict(verify_rho=args.verify_rho, verify_window=args.verify_window, verify_final=True)
    servers = {
        "continuous": (
            RoutedEngine(slm, llm, RandomRouter(args.llm_fraction, seed=0), eos_token_id=eos),
            True,
        ),
        "continuous_shared": (
            RoutedEngine(slm, llm, RandomRouter(args.llm_fraction, seed=0), eos_token_id=eos, **shared),
            True,
        ),
        "one_at_a_time": (
            RoutedEngine(slm, llm, RandomRouter(args.llm_fraction, seed=0), eos_token_id=eos),
            False,
        ),
        "llm_only": (RoutedEngine(slm, llm, AlwaysLLM(), eos_token_id=eos), True),
        "continuous_verified": (
            RoutedEngine(slm, llm, RandomRouter(args.llm_fraction, seed=0), eos_token_id=eos, **verify),
            True,
        ),
    }
    # Every server runs at once (an idle one costs nothing); each level is measured server after server, in
    # alternating order over --rounds rounds, and each server's best round is kept: drifting load on a shared
    # machine then biases every server alike.
    best: dict[tuple[str, int], dict] = {}
    every: dict[
        tuple[str, int], list[dict]
    ] = {}  # each round's headline numbers, kept so the spread is reported
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, (engine, continuous) in servers.items():
            app = build_app(engine, tok, model_name=MODEL, max_new_tokens=max_tokens, fmt="raw",
                            continuous_batching=continuous, max_batch_rows=64, max_queued_requests=256)  # fmt: skip
            bases[name] = stack.enter_context(serving_in_background(app))
            load(bases[name], prompts[:2], 1, 1, 2)  # warm-up
        res, _ = load(bases["continuous"], prompts, 1, len(prompts), max_tokens)  # each prompt served alone
        alone = {r["prompt"]: r["text"] for r in res}
        # verified answers differ from plain routing's by design: compare them with their own, served alone
        res, _ = load(bases["continuous_verified"], prompts, 1, len(prompts), max_tokens)
        alone_verified = {r["prompt"]: r["text"] for r in res}
        for rnd in range(args.rounds):
            for c in levels:
                for name in list(servers)[:: 1 if rnd % 2 == 0 else -1]:
                    res, wall = load(bases[name], prompts, c, per_client[c], max_tokens)
                    ref = {"llm_only": {}, "continuous_verified": alone_verified}.get(name, alone)
                    r = summarise(name, c, res, wall, ref)
                    print(f"round {rnd} {name:<17} clients {c:>3}: {r['tokens_per_s']:8.1f} tok/s  p50 "
                          f"{r['p50_latency_s']:.3f} s  p99 {r['p99_latency_s']:.3f} s  ttft/latency "
                          f"{r['ttft_over_latency'] or float('nan'):.2f}  lost {r['lost']}  differ "
                          f"{r['differ_from_alone']}", flush=True)  # fmt: skip
                    seen = every.setdefault((name, c), [])
                    seen.append({k: r[k] for k in ("tokens_per_s", "p50_latency_s", "ttft_over_latency")})
                    old = best.get((name, c))
                    if old is None or r["tokens_per_s"] > old["tokens_per_s"]:
                        # Losses and differences count over every round, not only the kept one.
                        r["lost"] += old["lost"] if old else 0
                        r["differ_from_alone"] += old["differ_from_alone"] if old else 0
                        best[name, c] = r
                    else:
                        old["lost"] += r["lost"]
                        old["differ_from_alone"] += r["differ_from_alone"]
    rows = [best[name, c] | {"rounds": every[name, c]} for name in servers for c in levels]
    by = {(r["server"], r["clients"]): r for r in rows}
    ratios = {
        f"continuous_shared_vs_one_at_a_time_at_{c}": by["continuous_shared", c]["tokens_per_s"]
        / by["one_at_a_time", c]["tokens_per_s"]
        for c in levels
    }
    ratios |= {
        f"continuous_vs_one_at_a_time_at_{c}": by["continuous", c]["tokens_per_s"]
        / by["one_at_a_time", c]["tokens_per_s"]
        for c in levels
    }
    ratios |= {
        f"continuous_vs_llm_only_at_{c}": by["continuous", c]["tokens_per_s"]
        / by["llm_only", c]["tokens_per_s"]
        for c in levels
    }
    ratios |= {
        f"continuous_verified_ttft_vs_continuous_at_{c}": by["continuous_verified", c]["p50_ttft_s"]
        / by["continuous", c]["p50_ttft_s"]
        for c in levels
        if by["continuous", c].get("p50_ttft_s")
    }
    report = dict(
        verify=verify,
        pair=args.models or "embedded architectures, random weights",
        llm_fraction=args.llm_fraction,
        shared=shared,
        max_tokens=max_tokens,
        torch_threads=torch.get_num_threads(),
        rows=rows,
        ratios=ratios,
        rounds=args.rounds,
        note="one run on a shared CPU; compare ratios, not absolute numbers; best of the rounds per server and level",
    )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    write_json(args.out, report)
    stamp_bench(args.out, "serving", args, time.perf_counter() - started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
