"""The variants ``bench/speed.py`` times at one pair, dtype and batch: warm-ups, then interleaved reps under the time
budget, each variant's row saved after every rep.

- LLM alone first (the baselines): ``hf_llm_static_compiled`` (``generate`` with a static cache, compiled: CUDA
  graphs on a GPU, Inductor on a CPU), ``engine_llm`` (our engine, ``--forward``), ``engine_llm_eager``, ``hf_llm``
  (eager ``generate``), the peers (``llama_cpp_llm``, ``vllm_llm``; llama.cpp also quantized by its own quantizer,
  ``llama_cpp_llm_q8_0``..., each row's ``precision`` its type);
- then ``engine_slm``, a random router at LLM probability p (``routed_f{p}``; at batch > 1 ``shared_f{p}``,
  ``overlap_f{p}``, ``overlap_shared_f{p}``), at batch 1 assisted generation with the SLM drafting
  (``assisted_alpha{a}``: both models forced to agree at a fraction a of positions), and with ``--hf-forward`` every
  engine row not compiled again through the HF modules' forward (``*_hf_forward``).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.speed_report import PAIRS, SPECS, BenchRun, BuiltPair, plain_bytes
from citer.decoding.baselines import AlwaysSLM, RandomRouter
from citer.decoding.cost import ModelCost, call_tally
from citer.decoding.engine import ENGINE_SETTINGS, RoutedEngine, engine_from_block
from citer.decoding.lean import lean_decoder
from citer.decoding.runner import FORWARDS
from citer.decoding.speculative import assistant_setup
from citer.decoding.static_step import step_stats
from citer.ops.openmp import peer_environ


class AgreeProcessor:
    """transformers logits processor: masks ids >= ``vocab`` (the pair's shared ids) and, at a pseudo-random fraction
    ``alpha`` of positions (a hash of the prefix's length and last token), forces one token derived from the prefix.
    Applied to both models of assisted generation, they then agree exactly there: a controlled acceptance rate."""

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


@dataclass
class Variant:
    """One decoder to time: ``run(n)`` generates ``n`` tokens per row and returns what the row needs (the engine's
    stats, or the assisted tallies); ``meta`` goes into the row as is. An ``external`` variant runs in a process of
    its own that warms up and times its reps itself: ``run`` returns them (``reps_s``)."""

    name: str
    run: Callable[[int], dict[str, Any]]
    meta: dict[str, Any]
    engine: RoutedEngine | None = None
    compiles: bool = False  # its warm-up compiles (kept for when enough time is left)
    external: bool = False


def engine_settings(e: RoutedEngine) -> dict[str, Any]:
    """What decides how an engine runs its calls: recorded per row, so a report says which engine it timed."""
    return {k: getattr(e, k) for k in (*ENGINE_SETTINGS, "tau", "vocab_size")} | {
        "forward_paths": e.forward_paths
    }


def forward_compiles(forward: str) -> bool:
    """Whether an engine's ``forward`` compiles anything (the compiled ragged forward, or fixed-shape steps with a
    backend), read from the runner's own table."""
    kind, mode = FORWARDS[forward]
    return kind == "compiled" or (mode is not None and mode.backend is not None)


def engine_block(path: Path) -> dict[str, Any]:
    """The ``engine:`` block of the params at ``path``: as ``citer route`` reads it (checked, defaults filled) where
    the project's config imports, else (the GPU image has no pydantic) the block as written, which the engine checks
    setting by setting."""
    try:
        from citer.config import load_params
    except ImportError:
        import yaml

        return dict(yaml.safe_load(path.read_text(encoding="utf-8")).get("engine") or {})
    return load_params(path).engine.model_dump()


def variants(
    run: BenchRun, models: BuiltPair, prompts: list[list[int]]
) -> tuple[list[Variant], list[Variant]]:
    """The LLM-only baselines with the routed rows, then everything else, at this pair, dtype and batch."""
    a = run.args
    slm, llm, vocab = models.slm, models.llm, models.vocab
    batch, n_cols = len(prompts), a.prompt_len + a.new_tokens + 1
    ids = torch.tensor(prompts, dtype=torch.long, device=run.device)  # (B, P), equal lengths: no padding
    cut = AgreeProcessor(vocab, 0.0)

    def hf(model: Any, **extra: Any) -> Callable[[int], dict[str, Any]]:
        from transformers import LogitsProcessorList

        def go(n: int) -> dict[str, Any]:
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([cut]), **extra,
            )  # fmt: skip
            return {}

        return go

    def eng(e: RoutedEngine) -> Callable[[int], dict[str, Any]]:
        e.reserve(batch, n_cols)  # the pools' final size before anything runs: no capture inside a timed rep

        def go(n: int) -> dict[str, Any]:
            return {"stats": e.generate_batch(prompts, n).batch, "forward": e.forward_paths}

        return go

    block = engine_block(Path(a.params))
    if block.get("runner", "torch") != "torch":
        raise ValueError(
            f"{a.params}: engine.runner {block['runner']!r}: bench/speed.py times the torch engine "
            "(bench/llama_cpp_routed.py times llama.cpp's)"
        )
    block["forward"] = a.forward  # the block's own unless --forward replaced it (bench/speed.py resolves it)
    run.report["engine"] = block  # the block the engines are built from, beside each variant's own settings

    def build(s: Any, m: Any, router: Any, **over: Any) -> RoutedEngine:
        """An engine as ``citer route`` builds it (:func:`~citer.decoding.engine.engine_from_block` on the params'
        engine block, ``--forward`` and ``over``, the variant's own settings, replacing theirs)."""
        return engine_from_block(s, m, router, 0.5, block | over, vocab_size=vocab)

    def engine(name: str, e: RoutedEngine, f: float, **meta: Any) -> Variant:
        info = {"method": name.rsplit("_f", 1)[0] if "_f" in name else name, "f": f, "engine_forward": e.forward,
                "overlap": e.overlap, "engine": engine_settings(e), **meta}  # fmt: skip
        return Variant(name, eng(e), info, e, compiles=forward_compiles(e.forward))

    # The routed rows time in the baselines' group, in turn with them: the headline ratio is read between reps taken
    # side by side (this host's speed drifts between a group's minutes and the next's).
    routed = [engine(f"routed_f{p:g}", build(slm, llm, RandomRouter(p, seed=0)), p) for p in a.fractions]
    base: list[Variant] = []
    if a.compile and batch in a.compile_batches:
        base.append(Variant("hf_llm_static_compiled", hf(llm, **_static_compile(run)),
                            {"method": "hf_generate_static_compiled", "model": "llm", "f": 1.0}, compiles=True))  # fmt: skip
    base.append(engine("engine_llm", build(llm, None, AlwaysSLM()), 1.0, model="llm"))
    base += routed
    if a.engine_eager:
        base.append(
            engine("engine_llm_eager", build(llm, None, AlwaysSLM(), forward="eager"), 1.0, model="llm")
        )
    base.append(Variant("hf_llm", hf(llm), {"method": "hf_generate", "model": "llm", "f": 1.0}))
    llama = SPECS[PAIRS[models.name][1]]["family"] == "llama"
    llama_cpp = bool(a.llama_cpp_python) and batch in a.llama_cpp_batches
    if llama_cpp and not llama:
        run.note(f"{models.name}: no llama.cpp rows (the peer writes Llama-architecture GGUF files only)")
    if llama_cpp and llama:
        base.append(_peer(run, models, "llm", "llama_cpp", batch))
    if a.vllm_python:
        base.append(_peer(run, models, "llm", "vllm", batch))

    rest = [engine("engine_slm", build(slm, None, AlwaysSLM()), 0.0, model="slm")]
    if batch > 1:
        rows = min(a.min_rows or max(2, batch // 4), batch)  # --min-rows, or a quarter of the batch
        share = {"llm_min_rows": rows, "llm_max_wait_steps": a.max_wait_steps}
        for p in a.fractions:
            e = build(slm, llm, RandomRouter(p, seed=0), **share)
            rest.append(engine(f"shared_f{p:g}", e, p, **share))
        for p in a.overlap_fractions:
            e = build(slm, llm, RandomRouter(p, seed=0), overlap=True)
            rest.append(engine(f"overlap_f{p:g}", e, p))
            e = build(slm, llm, RandomRouter(p, seed=0), overlap=True, **share)
            rest.append(engine(f"overlap_shared_f{p:g}", e, p, **share))
    if llama_cpp and llama:
        rest.append(_peer(run, models, "slm", "llama_cpp", batch))
    if batch == 1:
        for alpha in a.alphas:
            rest.append(_assisted(run, models, ids, alpha))
    if a.hf_forward:  # the lean forward's A/B: the same engines through the HF modules' forward
        eager = [v for v in (*base, *rest) if v.engine is not None and not v.compiles]
        rest += [_hf_forward(v) for v in eager]
    return base, rest


def _hf_forward(v: Variant) -> Variant:
    """``v``'s engine with its runners on the HF modules' forward for the timed calls (then back)."""

    def go(n: int) -> dict[str, Any]:
        runners = [r for r in (v.engine.slm_runner, v.engine.llm_runner) if r is not None]
        kinds = [r.forward_kind for r in runners]
        for r in runners:
            r.forward_kind = "hf"
        try:
            return v.run(n)
        finally:
            for r, k in zip(runners, kinds, strict=True):
                r.forward_kind = k

    return Variant(f"{v.name}_hf_forward", go, v.meta, v.engine)


def _static_compile(run: BenchRun) -> dict[str, Any]:
    """``generate`` kwargs for transformers' own compiled decoding: a static cache, which it compiles by itself on a
    GPU (``reduce-overhead``: CUDA graphs); on a CPU it is asked to (Inductor's default mode)."""
    from transformers import CompileConfig

    kw: dict[str, Any] = {"cache_implementation": "static"}
    if not run.device.startswith("cuda"):
        cc = CompileConfig(mode="default")
        cc._compile_all_devices = True
        kw["compile_config"] = cc
    return kw


def gguf_arrays(model: Any) -> dict[str, Any]:
    """A Llama-architecture HF model's tensors under their GGUF names, as llama.cpp's converter writes them
    (:func:`citer.models.to_gguf.gguf_tensors`: q/k rows permuted, a tied head left out); numpy arrays, bf16 as its
    bits (uint16: numpy has no bf16), for the peer's environment to write without torch."""
    from citer.models.to_gguf import gguf_tensors

    out = {}
    for name, t in gguf_tensors(model).items():
        t = t.contiguous()
        out[name] = t.view(torch.int16).numpy().view("uint16") if t.dtype is torch.bfloat16 else t.numpy()
    return out


def peer_missing(python: str, code: str) -> str | None:
    """Why ``python`` cannot run ``code`` (a peer's imports, the names it needs), in one line; None where it can."""
    import subprocess

    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {type(exc).__name__}: {exc}"
    if res.returncode:
        return f"{python} -c {code!r}: {(res.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _peer(run: BenchRun, models: BuiltPair, which: str, peer: str, batch: int) -> Variant:
    """A peer decoding one model of the pair alone in an environment of its own (``bench/speed.py peer``), from the
    same random weights: llama.cpp (``--llama-cpp-python``; the weights as ``.npy`` files it writes into a GGUF file,
    kept with its quantized copies in the run's scratch directory for the next batch) or vLLM's CPU backend
    (``--vllm-python``; an HF model directory)."""
    import json
    import subprocess
    import tempfile

    import numpy as np

    model = models.llm if which == "llm" else models.slm
    a = run.args
    python = a.llama_cpp_python if peer == "llama_cpp" else a.vllm_python

    def go(n: int) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            if peer == "vllm":
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"citer_{peer}_"))
                out = Path(tmp)
                model.save_pretrained(out / "hf")
            else:
                out = run.scratch(f"{peer}_{models.name}_{models.dtype}_{which}")
                tmp = str(out)
                if not (out / "model.gguf").exists():
                    for name, arr in gguf_arrays(model).items():
                        np.save(out / f"{name}.npy", arr)
            c = model.config
            cfg = dict(dtype=models.dtype, dtype_name=str(model.dtype).removeprefix("torch."), batch=batch,
                       hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                       intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, rope_theta=float(c.rope_parameters["rope_theta"]),
                       rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                       max_position_embeddings=c.max_position_embeddings, prompt_len=a.prompt_len, new_tokens=n,
                       reps=a.reps, threads=torch.get_num_threads(),
                       quants=a.llama_cpp_quants if peer == "llama_cpp" else [])  # fmt: skip
            (out / "config.json").write_text(json.dumps(cfg))
            script = Path(__file__).with_name("speed.py")
            env = {**peer_environ(), "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
            cmd = [python, str(script), "peer", peer, tmp]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
            for npy in out.glob("*.npy"):  # in the GGUF file now
                npy.unlink()
            line = next((x for x in res.stdout.splitlines() if x.startswith('{"reps_s"')), None)
            if res.returncode != 0 or line is None:
                raise RuntimeError(f"{peer}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
            return json.loads(line)

    meta = {"method": peer, "model": which, "f": 1.0 if which == "llm" else 0.0, "peer": peer}
    return Variant(f"{peer}_{which}", go, meta, external=True)


# A peer's fields its rows keep (the generated tokens stay out of the report).
_PEER_FIELDS = ("system_info", "flash_attn", "quantize_s", "file_bytes", "weight_bytes", "tensor_types",
                "quantize_fallbacks", "quantize_warnings")  # fmt: skip


def _assisted(run: BenchRun, models: BuiltPair, ids: torch.Tensor, alpha: float) -> Variant:
    """Assisted generation (the SLM drafts ``--draft-tokens`` a call, the LLM verifies) at forced agreement ``alpha``."""
    from transformers import LogitsProcessorList

    slm, llm = models.slm, models.llm
    proc = LogitsProcessorList([AgreeProcessor(models.vocab, alpha)])

    def go(n: int) -> dict[str, Any]:
        with (
            assistant_setup(slm, llm, run.args.draft_tokens),
            call_tally(slm, llm) as tally,
        ):
            out = llm.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=slm, max_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=proc,
            )  # fmt: skip
        t = {"llm_calls": tally.llm[0], "slm_calls": tally.slm[0], "bytes": tally.bytes(models.costs)}
        return {"tally": t, "generated": int(out.shape[1] - ids.shape[1])}

    meta = {"method": "hf_assisted", "alpha": alpha, "draft_tokens": run.args.draft_tokens}
    return Variant(f"assisted_alpha{alpha:g}", go, meta)


def measure(run: BenchRun, models: BuiltPair, batch: int) -> None:
    """Every variant at ``batch``: the LLM-only baselines and the routed rows first, then the rest; each group warmed
    up, then timed in interleaved reps (drift biases every variant of a group alike). The budget is checked before
    every warm-up and rep, and the report saved after each, so a run cut short keeps what it measured."""
    prompts = run.prompts(models.vocab, batch, seed=batch)
    try:
        groups = variants(run, models, prompts)
    except Exception as exc:
        run.error(f"{models.name} {models.dtype} batch {batch}: building variants", exc)
        return
    for group in groups:
        for v in group:
            if v.external:
                _external(run, models, batch, v)
        ready = [v for v in group if not v.external and _warm_up(run, models, batch, v)]
        for rep in range(run.args.reps):
            for v in ready:
                row = _row_of(run, models, batch, v)
                last = row["reps_s"][-1] if row["reps_s"] else 0.0
                if run.left() < last + 5:
                    run.note(
                        f"{models.name} {models.dtype} b{batch} {v.name} rep {rep}: skipped, budget spent"
                    )
                    continue
                try:
                    sec, info = run.timed(lambda v=v: v.run(run.args.new_tokens))
                except Exception as exc:
                    run.error(f"{models.name} {models.dtype} b{batch} {v.name} rep {rep}", exc)
                    continue
                row["reps_s"].append(round(sec, 5))
                _fill(run, models, batch, v, row, info)
                run.save()
        for v in ready:
            row = _row_of(run, models, batch, v)
            if row["reps_s"]:
                run.print_row(row)


def _external(run: BenchRun, models: BuiltPair, batch: int, v: Variant) -> None:
    """A peer in a process of its own: it warms up and times its reps; they fill its row like any other's. A peer that
    also ran quantized copies of the model (llama.cpp: ``quantized``) fills a row for each, ``{name}_{type}``, its
    precision that type and its bytes per call those of the quantized file."""
    where = f"{models.name} {models.dtype} b{batch} {v.name}"
    if run.left() < 60:
        run.note(f"{where}: skipped, {run.left():.0f}s left")
        return
    try:
        got = v.run(run.args.new_tokens)
    except Exception as exc:
        run.error(where, exc)
        return
    runs = [(v, got, {})]
    for q, res in got.get("quantized", {}).items():
        sub = Variant(f"{v.name}_{q}", v.run, {**v.meta, "precision": q}, external=True)
        same = {k: got[k] for k in ("version", "system_info") if k in got}
        runs.append((sub, {**same, **res}, {"weight_bytes": res["weight_bytes"]}))
    for var, res, info in runs:
        row = _row_of(run, models, batch, var)
        row["reps_s"] = [round(x, 5) for x in res["reps_s"]]
        row["warmup_s"] = round(res["warmup_s"], 3)
        row["peer_version"] = res.get("version")
        row.update({f"peer_{k}": res[k] for k in _PEER_FIELDS if k in res})
        _fill(run, models, batch, var, row, info)
        run.save()
        run.print_row(row)


def _warm_up(run: BenchRun, models: BuiltPair, batch: int, v: Variant) -> bool:
    """One untimed run at full length (per-shape setup, compiles and captures stay out of the timings), recording
    what it compiled and captured; False when there is no time for it or it failed."""
    need = run.args.compile_reserve if v.compiles else 10.0
    where = f"{models.name} {models.dtype} b{batch} {v.name}"
    if run.left() < need:
        run.note(f"{where}: skipped, {run.left():.0f}s left < {need:.0f}s for its warm-up")
        return False
    from torch._dynamo.utils import counters

    leans = [lean_decoder(m) for m in (models.slm, models.llm)]
    before = [step_stats(x).as_dict() if x is not None else None for x in leans]
    graphs0 = counters["stats"]["unique_graphs"]
    skips0 = counters["inductor"]["cudagraph_skips"]
    try:
        sec, _ = run.timed(lambda: v.run(run.args.new_tokens))
    except Exception as exc:
        run.error(f"{where} warm-up", exc)
        return False
    row = _row_of(run, models, batch, v)
    row["warmup_s"] = round(sec, 3)
    row["dynamo_graphs"] = counters["stats"]["unique_graphs"] - graphs0
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips0
    after = [step_stats(x).as_dict() if x is not None else None for x in leans]
    for key, b, a in zip(("slm", "llm"), before, after, strict=True):
        if a is None or b is None:
            continue
        for k in ("compiles", "compile_s", "captures", "capture_s", "recaptures", "fallbacks"):
            d = a[k] - b[k]
            if d:
                row.setdefault(f"{key}_{k}", round(d, 3))
    row["compiles"] = row.get("slm_compiles", 0) + row.get("llm_compiles", 0)
    run.save()
    return True


def _row_of(run: BenchRun, models: BuiltPair, batch: int, v: Variant) -> dict[str, Any]:
    key = (models.name, models.dtype, batch, v.name)
    for r in run.report["rows"]:
        if (r["pair"], r["dtype"], r["batch"], r["variant"]) == key:
            return r
    r = {"pair": models.name, "dtype": models.dtype, "precision": models.dtype, "batch": batch, "variant": v.name,
         **v.meta, "new_tokens": run.args.new_tokens, "prompt_len": run.args.prompt_len, "reps_s": []}  # fmt: skip
    run.report["rows"].append(r)
    return r


def _fill(
    run: BenchRun, models: BuiltPair, batch: int, v: Variant, row: dict[str, Any], info: dict[str, Any]
) -> None:
    """The row's counts from its latest rep, and its times from the reps so far (``--stat``)."""
    a = run.args
    n_new = a.new_tokens
    if "generated" in info:  # assisted: tokens, calls and bytes from the forward hooks
        n_new = row["new_tokens"] = info["generated"]
        t = info["tally"]
        row.update(llm_calls=t["llm_calls"], slm_calls=t["slm_calls"], llm_calls_per_token=t["llm_calls"] / n_new,
                   tokens_per_llm_call=n_new / t["llm_calls"], bytes_per_token=t["bytes"] / n_new)  # fmt: skip
        row["draft_acceptance_approx"] = max(
            0.0, (n_new - t["llm_calls"]) / (t["llm_calls"] * a.draft_tokens)
        )
    elif "stats" in info:
        st = info["stats"]
        row["forward"] = info.get("forward")
        steps = st.decode_steps or n_new
        alone = v.engine is not None and v.engine.llm is None
        calls = st.slm_calls if alone and v.meta.get("model") == "llm" else st.llm_calls
        row.update(decode_steps=steps, llm_calls=calls, llm_calls_per_token=calls / st.new_tokens,
                   llm_calls_per_step=calls / steps, overlapped_steps=st.overlapped_steps,
                   wait_row_steps=st.wait_row_steps, bytes_per_token=st.bytes_moved / st.new_tokens)  # fmt: skip
        llm_alone = alone and v.meta.get("model") == "llm"
        row["llm_fraction"] = 1.0 if llm_alone else 0.0 if alone else st.llm_fraction
    else:
        cost = models.costs[0] if v.meta.get("model") == "slm" else models.costs[1]
        if "weight_bytes" in info:  # a quantized copy: its own bytes per call, the same KV
            cost = ModelCost(info["weight_bytes"], cost.kv_bytes_per_token)
        row["bytes_per_token"] = plain_bytes(cost, batch, a.prompt_len, n_new) / (batch * n_new)
        row["llm_fraction"] = v.meta.get("f")
        row["llm_calls_per_step"] = 0.0 if v.meta.get("model") == "slm" else 1.0
    row["bw_limit_ms_per_token"] = 1e3 * row["bytes_per_token"] / run.bandwidth
    pick = min if a.stat == "min" else statistics.median
    w = pick(row["reps_s"])
    row["ms_per_token"] = 1e3 * w / (batch * n_new)
    row["tokens_per_s"] = batch * n_new / w
    row["ratio_to_bw"] = row["ms_per_token"] / row["bw_limit_ms_per_token"]
