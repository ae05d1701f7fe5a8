"""GPU bench of routed decoding at real shapes: ``python bench/gpu.py --out reports/bench_gpu.json``.

Needs only torch and transformers (and numpy, which both pull in): a GPU box may hold the ML stack without Prefect,
MLflow or DVC, so nothing here imports more than ``citer.decoding``.

Random-weight Qwen2 pairs at real shapes in bf16 (``0.5b-7b``: Qwen2-0.5B / Qwen2-7B; ``1.5b-14b``: Qwen2-1.5B /
Qwen2.5-14B), built directly on the GPU. Prompts are random token ids and there is no EOS, so every row generates
exactly ``--new-tokens``. Per pair and batch size (1, 8, 32), per generated token:

- ``hf_llm`` / ``hf_slm``: transformers ``generate`` (dynamic cache, eager); ``hf_llm_static_compiled`` /
  ``hf_slm_static_compiled`` (``--compile``): static cache, which makes ``generate`` compile the decode step with
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); compile time reported beside it;
- ``engine_llm`` / ``engine_slm``: our engine decoding with one model alone (``RoutedEngine(m, None, AlwaysSLM())``);
- ``routed_f{p}``: our engine, random router sending a token to the LLM with probability p = 0.05/0.1/0.3;
  ``routed_always_llm`` (batch 1): every token to the LLM (the SLM still runs every step);
- ``shared_f{p}`` (batch > 1): the same with shared LLM calls (``llm_min_rows``, ``llm_max_wait_steps``);
- ``assisted_*`` (batch 1): transformers assisted generation (``generate(assistant_model=slm)``), constant draft
  length ``--draft-tokens``. Random models never agree, so besides natural acceptance (~0) a logits processor makes
  both models agree on a pseudo-random fraction ``alpha`` of positions (a hash of the prefix), giving a controlled
  acceptance rate.

Each time is the median of ``--reps`` interleaved runs after a warm-up, with ``torch.cuda.synchronize`` around each.
Ratios: ``ratio_to_ideal = t / (f * t_LLM + t_SLM)`` (t_LLM, t_SLM: ``engine_llm``/``engine_slm`` at the same batch,
f the measured LLM fraction) and ``ratio_to_bw = t / (bytes moved per token / bandwidth)`` (bytes as
:mod:`citer.decoding.cost` counts them; bandwidth 3.35 TB/s for an H100). Results are written after every
measurement (atomically), so a run stopped by a time limit still leaves what it measured. ``--tiny``: tiny models on
the CPU in float32, a seconds-long smoke run of every code path (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# A citer already on the path (PYTHONPATH: e.g. a pinned copy of one commit) wins over this checkout's.
if importlib.util.find_spec("citer") is None:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from citer.decoding.baselines import AlwaysLLM, AlwaysSLM, RandomRouter  # noqa: E402
from citer.decoding.cost import GPU_BANDWIDTH, ModelCost  # noqa: E402
from citer.decoding.engine import RoutedEngine  # noqa: E402
from citer.decoding.speculative import assistant_setup  # noqa: E402

# Real configs (hidden, intermediate, layers, heads, kv heads, vocab rows, tied embeddings) of the Qwen2 family.
SPECS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(hidden=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tie=True),
    "qwen2-1.5b": dict(hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tie=True),
    "qwen2-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tie=False),
    "qwen2.5-14b": dict(hidden=5120, inter=13824, layers=48, heads=40, kv=8, vocab=152064, tie=False),
    # --tiny: same structure (GQA, tied SLM head, different vocab rows), seconds on a CPU.
    "tiny-slm": dict(hidden=32, inter=64, layers=2, heads=4, kv=2, vocab=512, tie=True),
    "tiny-llm": dict(hidden=64, inter=128, layers=3, heads=4, kv=2, vocab=520, tie=False),
}
PAIRS: dict[str, tuple[str, str]] = {
    "0.5b-7b": ("qwen2-0.5b", "qwen2-7b"),
    "1.5b-14b": ("qwen2-1.5b", "qwen2.5-14b"),
    "tiny": ("tiny-slm", "tiny-llm"),
}
SHARED_KWARGS = ("llm_min_rows", "llm_max_wait_steps")


# ----------------------------------------------------------------------------------------------------------- models
def build_model(name: str, device: str, dtype: torch.dtype, seed: int) -> Any:
    """A random-weight Qwen2ForCausalLM of spec ``name``, built on ``device`` in ``dtype`` (no CPU detour)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = SPECS[name]
    cfg = Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"], tie_word_embeddings=s["tie"],
        max_position_embeddings=32768, rope_theta=1_000_000.0, use_sliding_window=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, 0
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    model.config._name_or_path = name
    return model


def n_params(model: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------------------------------------- timing
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_bytes(cost: ModelCost, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes of plain decoding as :class:`citer.decoding.cost.CostMeter` counts them: one prefill call, then
    ``new_tokens - 1`` one-token calls, each reading the weights once and every row's KV."""
    total = cost.weight_bytes + batch * cost.kv_bytes_per_token * 2 * prompt_len
    for i in range(1, new_tokens):
        total += cost.weight_bytes + batch * cost.kv_bytes_per_token * (prompt_len + i + 1)
    return float(total)


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


@contextlib.contextmanager
def call_counter(slm: Any, llm: Any, costs: tuple[ModelCost, ModelCost], batch: int):
    """Counts every forward call of both models and the bytes it moves (weights once, KV of every row)."""
    tally = {"slm_calls": 0, "llm_calls": 0, "slm_tokens": 0, "llm_tokens": 0, "bytes": 0.0}

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


# ------------------------------------------------------------------------------------------------------------ bench
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.device = "cpu" if args.tiny else "cuda"
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        sig = inspect.signature(RoutedEngine.__init__).parameters
        self.has_shared = all(k in sig for k in SHARED_KWARGS)
        self.report: dict[str, Any] = {
            "bench": "bench/gpu.py",
            "created_unix": time.time(),
            "device": self._device_info(),
            "citer": {
                "path": str(Path(sys.modules[RoutedEngine.__module__].__file__).parents[2]),
                "commit": os.environ.get("CITER_COMMIT", "working tree"),
            },
            "host": host_probe(self.device),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "gpu_bandwidth_bytes_per_s": GPU_BANDWIDTH[args.gpu],
            "gpu_bandwidth_name": args.gpu,
            "dtype": str(self.dtype).replace("torch.", ""),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "shared_llm_calls": (
                "measured (RoutedEngine takes llm_min_rows, llm_max_wait_steps)"
                if self.has_shared
                else "skipped: this RoutedEngine has no llm_min_rows / llm_max_wait_steps"
            ),
            "definitions": {
                "ms_per_token": "wall time / tokens generated in the batch (batch * new_tokens), prefill included",
                "ms_per_row_token": "wall time / new_tokens (the latency a row sees per token)",
                "ideal_ms_per_token": "f * t(engine_llm) + t(engine_slm), same batch, f = measured LLM fraction",
                "bw_limit_ms_per_token": "bytes moved per token / bandwidth (weights once per call + KV read/written)",
                "llm_calls_per_step": "LLM forward calls / decoding steps (a step emits at most one token per row)",
            },
            "pairs": {},
            "rows": [],
            "notes": [],
            "errors": [],
        }
        if not self.has_shared:
            self.note("shared variants skipped: RoutedEngine has no llm_min_rows / llm_max_wait_steps")

    def _device_info(self) -> dict[str, Any]:
        if self.device == "cpu":
            return {"name": "cpu (--tiny smoke run; timings mean nothing)", "cuda": False}
        p = torch.cuda.get_device_properties(0)
        return {
            "name": torch.cuda.get_device_name(0),
            "cuda": True,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count,
            "cuda_version": torch.version.cuda,
        }

    # ---- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def left(self) -> float:
        return self.args.time_budget - self.elapsed()

    def note(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] note: {msg}", flush=True)
        self.report["notes"].append(msg)

    def error(self, where: str, exc: BaseException) -> None:
        msg = f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        print(f"[{self.elapsed():6.1f}s] ERROR {msg}\n{traceback.format_exc()}", flush=True)
        self.report["errors"].append(msg)

    def save(self) -> None:
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.report, f, indent=1, default=float)
            f.write("\n")
        os.replace(tmp, out)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        sync(self.device)
        t = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - t, out

    # ---- one pair
    def run_pair(self, pair: str) -> None:
        a = self.args
        slm_name, llm_name = PAIRS[pair]
        t = time.perf_counter()
        slm = build_model(slm_name, self.device, self.dtype, seed=1)
        llm = build_model(llm_name, self.device, self.dtype, seed=2)
        sync(self.device)
        build_s = time.perf_counter() - t
        costs = (ModelCost.from_model(slm), ModelCost.from_model(llm))
        vocab = min(SPECS[slm_name]["vocab"], SPECS[llm_name]["vocab"])
        self.report["pairs"][pair] = {
            "slm": slm_name,
            "llm": llm_name,
            "slm_params": n_params(slm),
            "llm_params": n_params(llm),
            "slm_weight_bytes_per_call": costs[0].weight_bytes,
            "llm_weight_bytes_per_call": costs[1].weight_bytes,
            "slm_kv_bytes_per_token": costs[0].kv_bytes_per_token,
            "llm_kv_bytes_per_token": costs[1].kv_bytes_per_token,
            "build_seconds": round(build_s, 1),
            "compile": {},
        }
        print(
            f"[{self.elapsed():6.1f}s] {pair}: {slm_name} {n_params(slm) / 1e9:.2f}B + {llm_name} "
            f"{n_params(llm) / 1e9:.2f}B params built in {build_s:.1f}s",
            flush=True,
        )
        self.save()
        try:
            with torch.inference_mode():
                for batch in a.batches:
                    if self.left() < 30:
                        self.note(f"{pair} batch {batch}: skipped, time budget spent")
                        continue
                    self.run_batch(pair, slm, llm, costs, vocab, batch)
                if a.profile and not a.tiny and self.left() > 60:
                    self.profile_engine(pair, slm, llm, vocab)
                if a.compile and not a.tiny:
                    self.run_compiled(pair, slm, llm, costs, vocab)
        finally:
            del slm, llm
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()

    def prompts(self, vocab: int, batch: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (batch, self.args.prompt_len), generator=g).tolist()

    def engines(
        self, slm: Any, llm: Any, vocab: int, batch: int
    ) -> dict[str, tuple[RoutedEngine, float | None]]:
        """name -> (engine, router p)."""
        a = self.args
        out: dict[str, tuple[RoutedEngine, float | None]] = {
            "engine_slm": (RoutedEngine(slm, None, AlwaysSLM(), vocab_size=vocab, gpu=a.gpu), 0.0),
            "engine_llm": (RoutedEngine(llm, None, AlwaysSLM(), vocab_size=vocab, gpu=a.gpu), 1.0),
        }
        for p in a.fractions:
            out[f"routed_f{p:g}"] = (
                RoutedEngine(slm, llm, RandomRouter(p, seed=0), tau=0.5, vocab_size=vocab, gpu=a.gpu),
                p,
            )
        if batch == 1:
            out["routed_always_llm"] = (RoutedEngine(slm, llm, AlwaysLLM(), vocab_size=vocab, gpu=a.gpu), 1.0)
        if batch > 1 and self.has_shared:
            kw = {"llm_min_rows": self.min_rows(batch), "llm_max_wait_steps": a.max_wait_steps}
            for p in a.fractions:
                out[f"shared_f{p:g}"] = (
                    RoutedEngine(
                        slm, llm, RandomRouter(p, seed=0), tau=0.5, vocab_size=vocab, gpu=a.gpu, **kw
                    ),
                    p,
                )
        return out

    def min_rows(self, batch: int) -> int:
        m = self.args.min_rows if self.args.min_rows > 0 else max(2, batch // 4)
        return max(1, min(m, batch))

    def run_batch(self, pair: str, slm: Any, llm: Any, costs: tuple, vocab: int, batch: int) -> None:
        a = self.args
        n_new, plen = a.new_tokens, a.prompt_len
        prompts = self.prompts(vocab, batch, seed=batch)
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # (B, P), equal lengths: no padding
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

        def eng(e: RoutedEngine) -> Callable[[int], dict]:
            def go(n: int) -> dict:
                return {"stats": e.generate_batch(prompts, n).batch}

            return go

        variants: dict[str, tuple[Callable[[int], dict], dict]] = {
            "hf_slm": (hf(slm), {"method": "hf_generate", "model": "slm", "f": 0.0}),
            "hf_llm": (hf(llm), {"method": "hf_generate", "model": "llm", "f": 1.0}),
        }
        for name, (e, p) in self.engines(slm, llm, vocab, batch).items():
            meta = {"method": name.rsplit("_f", 1)[0] if "_f" in name else name, "f": p}
            if name.startswith("shared"):
                meta.update(llm_min_rows=e.llm_min_rows, llm_max_wait_steps=e.llm_max_wait_steps)
            variants[name] = (eng(e), meta)

        # Warm-up (kernels, allocator, cuBLAS handles), then interleaved reps: drift biases every variant alike.
        for name, (fn, _) in variants.items():
            try:
                self.timed(lambda fn=fn: fn(a.warmup_tokens or n_new))
            except Exception as exc:  # a broken variant is reported, the others still run
                self.error(f"{pair} batch {batch} {name} warm-up", exc)
        walls: dict[str, list[float]] = {k: [] for k in variants}
        last: dict[str, dict] = {}
        for rep in range(a.reps):
            for name, (fn, _) in variants.items():
                if self.left() < 15 and walls[name]:
                    continue
                try:
                    sec, info = self.timed(lambda fn=fn: fn(n_new))
                except Exception as exc:
                    self.error(f"{pair} batch {batch} {name} rep {rep}", exc)
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
            if st is not None:
                steps = getattr(st, "decode_steps", 0) or None
                row["decode_steps"] = steps
                if name == "engine_llm":  # the LLM decoding alone, as the engine's only model
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
                row["llm_catchup_tokens"] = st.llm_catchup_tokens
                bytes_tok = st.bytes_moved / st.new_tokens
                if (
                    name not in ("engine_slm", "engine_llm")
                    and "engine_slm" in t_tok
                    and "engine_llm" in t_tok
                ):
                    ideal = f * t_tok["engine_llm"] + t_tok["engine_slm"]
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
        if batch == 1 and a.assisted:
            rows += self.run_assisted(pair, slm, llm, costs, vocab, ids, t_tok, rows)
        self.report["rows"] += rows
        self.save()
        self.print_rows(rows)

    def run_assisted(
        self,
        pair: str,
        slm: Any,
        llm: Any,
        costs: tuple,
        vocab: int,
        ids: torch.Tensor,
        t_tok: dict,
        done: list,
    ) -> list[dict]:
        """Assisted generation at batch 1: natural acceptance and forced agreement at each ``--alphas``."""
        from transformers import LogitsProcessorList

        a = self.args
        n_new = a.new_tokens
        rows = []
        for alpha in [0.0, *a.alphas]:
            name = f"assisted_alpha{alpha:g}"
            if self.left() < 20:
                self.note(f"{pair} {name}: skipped, time budget spent")
                continue
            proc = LogitsProcessorList([AgreeProcessor(vocab, alpha)])

            n_tok = (
                a.assisted_tokens if alpha == 0.0 else n_new
            )  # ~k+1 forward calls per token: keep it short
            reps = 1 if alpha == 0.0 else a.reps

            def go(n: int, proc=proc) -> tuple[torch.Tensor, dict]:
                with assistant_setup(slm, llm, a.draft_tokens), call_counter(slm, llm, costs, 1) as tally:
                    out = llm.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=slm, max_new_tokens=n,
                        do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=proc,
                    )  # fmt: skip
                return out, dict(tally)

            try:
                self.timed(lambda go=go, k=a.warmup_tokens or n_tok: go(k))
                walls, tally, gen = [], {}, None
                for _ in range(reps):
                    sec, (gen, tally) = self.timed(lambda go=go, n_tok=n_tok: go(n_tok))
                    walls.append(sec)
            except Exception as exc:
                self.error(f"{pair} {name}", exc)
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
                row["routed_ms_at_same_llm_calls"] = 1e3 * _interp(routed, c)
                row["assisted_over_routed"] = t / _interp(routed, c)
            rows.append(row)
        return rows

    # ---- static cache + CUDA graphs (torch.compile reduce-overhead) for HF generate
    def run_compiled(self, pair: str, slm: Any, llm: Any, costs: tuple, vocab: int) -> None:
        a = self.args
        from transformers import LogitsProcessorList

        comp = self.report["pairs"][pair]["compile"]
        models = [(k, m) for k, m in (("llm", llm), ("slm", slm)) if k in a.compile_models.split(",")]
        for key, model in models:
            for batch in a.compile_batches:
                name = f"hf_{key}_static_compiled"
                if self.left() < a.compile_reserve:
                    self.note(
                        f"{pair} {name} batch {batch}: skipped, {self.left():.0f}s left < {a.compile_reserve}s"
                    )
                    continue
                prompts = self.prompts(vocab, batch, seed=batch)
                ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
                proc = LogitsProcessorList([AgreeProcessor(vocab, 0.0)])

                def go(n: int, model=model, ids=ids, proc=proc) -> None:
                    model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=proc,
                        cache_implementation="static",
                    )  # fmt: skip

                try:
                    first, _ = self.timed(lambda: go(a.new_tokens))  # compiles (and captures graphs)
                    second, _ = self.timed(lambda: go(a.new_tokens))  # may still capture for new shapes
                    walls = [self.timed(lambda: go(a.new_tokens))[0] for _ in range(a.reps)]
                except Exception as exc:
                    self.error(f"{pair} {name} batch {batch}", exc)
                    comp[f"{key}_b{batch}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    self.save()
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
                self.report["rows"].append(row)
                self.save()
                self.print_rows([row])

    # ---- where the engine's time goes (torch.profiler): GPU busy time vs wall, syncs and copies per step
    def profile_engine(self, pair: str, slm: Any, llm: Any, vocab: int) -> None:
        """torch.profiler over short engine runs: GPU kernel time vs wall, host syncs, copies and launches per step."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        a = self.args
        n = a.profile_tokens
        big = max(a.batches)
        cases: list[tuple[str, int, RoutedEngine]] = [
            ("engine_slm", 1, RoutedEngine(slm, None, AlwaysSLM(), vocab_size=vocab)),
            ("engine_llm", 1, RoutedEngine(llm, None, AlwaysSLM(), vocab_size=vocab)),
            ("routed_f0.1", 1, RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), tau=0.5, vocab_size=vocab)),
            ("engine_slm", big, RoutedEngine(slm, None, AlwaysSLM(), vocab_size=vocab)),
            (
                "routed_f0.1",
                big,
                RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), tau=0.5, vocab_size=vocab),
            ),
        ]
        if self.has_shared:
            kw = {"llm_min_rows": self.min_rows(big), "llm_max_wait_steps": a.max_wait_steps}
            e = RoutedEngine(slm, llm, RandomRouter(0.1, seed=0), tau=0.5, vocab_size=vocab, **kw)
            cases.append(("shared_f0.1", big, e))
        out = {}
        for name, batch, e in cases:
            key = f"{name}_b{batch}"
            if self.left() < 30:
                self.note(f"profile {pair} {key}: skipped, time budget spent")
                continue
            prompts = self.prompts(vocab, batch, seed=batch)
            try:
                e.generate_batch(prompts, 4)
                wall, res = self.timed(lambda e=e, p=prompts: e.generate_batch(p, n))
                steps = getattr(res.batch, "decode_steps", 0) or n
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    pwall, _ = self.timed(lambda e=e, p=prompts: e.generate_batch(p, n))
                ev = prof.key_averages()
                dev_us = sum(_self_device_us(x) for x in ev if x.device_type == DeviceType.CUDA)
                counts = {x.key: x.count for x in ev}
                cpu_ops = [x for x in ev if x.device_type == DeviceType.CPU]
                cpu_top = sorted(cpu_ops, key=lambda x: x.self_cpu_time_total, reverse=True)[:12]
                names = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync",
                         "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "aten::copy_", "aten::index_put_",
                         "aten::index_select", "aten::nonzero")  # fmt: skip
                out[key] = {
                    "batch": batch,
                    "new_tokens": n,
                    "decode_steps": steps,
                    "wall_s": wall,
                    "wall_ms_per_step": 1e3 * wall / steps,
                    "wall_s_profiled": pwall,
                    "gpu_kernel_ms_per_step": dev_us / 1e3 / steps,
                    "gpu_busy_fraction": dev_us / 1e6 / wall,
                    "per_step": {k: counts.get(k, 0) / steps for k in names},
                    "top_self_cpu_ms_per_step": {
                        x.key: round(x.self_cpu_time_total / 1e3 / steps, 3) for x in cpu_top
                    },
                }
                print(
                    f"[{self.elapsed():6.1f}s] profile {pair} {key}: wall {1e3 * wall / steps:.2f} ms/step, "
                    f"GPU kernels {dev_us / 1e3 / steps:.2f} ms/step ({100 * dev_us / 1e6 / wall:.0f}% busy); "
                    f"per step {out[key]['per_step']}",
                    flush=True,
                )
            except Exception as exc:
                self.error(f"profile {pair} {key}", exc)
        self.report["pairs"][pair]["profile"] = out
        self.save()

    def print_rows(self, rows: list[dict]) -> None:
        for r in rows:
            print(
                f"[{self.elapsed():6.1f}s] {r['pair']:<9} b{r['batch']:<3} {r['variant']:<26}"
                f" {r['ms_per_token']:8.3f} ms/tok  {r['tokens_per_s']:9.1f} tok/s"
                f"  f={_fmt(r.get('llm_fraction'))}  ideal×{_fmt(r.get('ratio_to_ideal'))}"
                f"  bw×{_fmt(r.get('ratio_to_bw'))}  llm/step={_fmt(r.get('llm_calls_per_step'))}",
                flush=True,
            )

    # ---- targets
    def summarize(self) -> None:
        derive_timings(self.report, self.args.stat)
        self.report["targets"] = targets(self.report)
        self.save()

    def run(self) -> int:
        a = self.args
        print(f"device: {self.report['device']['name']}; torch {torch.__version__}; "
              f"transformers {self.report['transformers']}; shared LLM calls: {self.report['shared_llm_calls']}",
              flush=True)  # fmt: skip
        self.save()
        for pair in a.pairs:
            if self.left() < 60:
                self.note(f"{pair}: skipped, time budget spent")
                continue
            try:
                self.run_pair(pair)
            except Exception as exc:
                self.error(f"pair {pair}", exc)
            self.save()
        self.summarize()
        print(json.dumps(self.report["targets"], indent=1, default=float))
        print(f"wrote {a.out} in {self.elapsed():.0f}s")
        return 0


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
        sl, ll = (
            idx.get((r["pair"], r["batch"], "engine_slm")),
            idx.get((r["pair"], r["batch"], "engine_llm")),
        )
        if sl is None or ll is None:
            continue
        if r["variant"].startswith(("routed", "shared")) and r.get("llm_fraction") is not None:
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
                y = _interp(curve, c)
                r["routed_ms_at_same_llm_calls"] = y
                r["assisted_over_routed"] = r["ms_per_token"] / y
    report["stat"] = stat


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


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through pts (sorted by x); linear extrapolation from the end segments."""
    if len(pts) == 1:
        return pts[0][1]
    i = 0
    while i < len(pts) - 2 and x > pts[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _self_device_us(evt: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _version(pkg: str) -> str:
    try:
        return __import__(pkg).__version__
    except Exception:  # pragma: no cover - reported, not fatal
        return "?"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="0.5b-7b,1.5b-14b", help=f"comma list of {sorted(PAIRS)}")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32])
    ap.add_argument(
        "--fractions", type=_floats, default=[0.05, 0.1, 0.3], help="random router LLM probabilities"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per variant (median reported)")
    ap.add_argument("--min-rows", type=int, default=0, help="shared: llm_min_rows (0: max(2, batch // 4))")
    ap.add_argument("--max-wait-steps", type=int, default=4, help="shared: llm_max_wait_steps")
    ap.add_argument(
        "--no-assisted", dest="assisted", action="store_false", help="skip HF assisted generation"
    )
    ap.add_argument("--draft-tokens", type=int, default=5, help="assisted: constant draft length")
    ap.add_argument("--assisted-tokens", type=int, default=32, help="assisted at natural acceptance: tokens")
    ap.add_argument(
        "--alphas", type=_floats, default=[0.9], help="assisted: forced agreement rates (besides 0)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="also HF generate with a static cache + torch.compile"
    )
    ap.add_argument("--compile-batches", type=_ints, default=[1])
    ap.add_argument(
        "--compile-reserve", type=float, default=120, help="skip a compile with fewer seconds left"
    )
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler of the engine, batch 1 and the largest"
    )
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--compile-models", default="llm,slm", help="which models --compile runs")
    ap.add_argument("--gpu", default="H100", choices=sorted(GPU_BANDWIDTH), help="bandwidth for the limit")
    ap.add_argument("--time-budget", type=float, default=540, help="seconds; later measurements are skipped")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run of every path")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="warm-up run length (0: the full length, so "
        "per-shape setup such as cuDNN attention plans for every KV length stays out of the timings)",
    )
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="over the timed reps")
    ap.add_argument(
        "--recompute",
        default="",
        help="comma list of result files: merge, re-derive with --stat, write --out (no GPU needed)",
    )
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_gpu.json"))
    args = ap.parse_args(argv)
    args.pairs = [p for p in args.pairs.split(",") if p]
    if args.tiny:
        args.pairs = ["tiny"]
    bad = [p for p in args.pairs if p not in PAIRS]
    if bad:
        ap.error(f"unknown pairs {bad}; choose from {sorted(PAIRS)}")
    if not args.tiny and not args.recompute and not torch.cuda.is_available():
        ap.error("no CUDA device; use --tiny for a CPU smoke run")
    return args


def recompute(files: list[str], stat: str, out: str) -> int:
    """Merge result files (one device, e.g. one pair per device call) and re-derive timings and targets."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    merged = copy.deepcopy(reports[0])
    merged["runs"] = []
    for f, r in zip(files, reports, strict=True):
        run = {
            k: r.get(k) for k in ("device", "host", "citer", "torch", "transformers", "settings", "elapsed_s")
        }
        merged["runs"].append({"file": Path(f).name, **run})
        if r is reports[0]:
            continue
        if r["device"].get("name") != merged["device"].get("name"):
            raise SystemExit(
                f"{f}: device {r['device'].get('name')!r} differs from {merged['device'].get('name')!r}"
            )
        merged["pairs"].update(r["pairs"])
        merged["rows"] += r["rows"]
        merged["notes"] += r["notes"]
        merged["errors"] += r["errors"]
    derive_timings(merged, stat)
    merged["targets"] = targets(merged)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=float) + "\n")
    os.replace(tmp, out)
    print(json.dumps(merged["targets"], indent=1, default=float))
    print(f"wrote {out} ({len(merged['rows'])} rows, stat {stat})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recompute:
        return recompute([f for f in args.recompute.split(",") if f], args.stat, args.out)
    torch.manual_seed(0)
    return Bench(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
