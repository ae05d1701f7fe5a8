"""Routed decoding against every LLM-only decoder, in wall-clock time at real shapes: ``python bench/speed.py``.

Random weights at real shapes, random prompt ids, no EOS (every row generates exactly ``--new-tokens``):

- ``--device cuda``: Qwen2 pairs in bf16 (``0.5b-7b``: Qwen2-0.5B / 7B; ``1.5b-14b``: Qwen2-1.5B / Qwen2.5-14B), our
  engine in ``--forward graphs`` (a compiled layer per model, a CUDA graph per bucket); on a lent GPU ``bash
  bench/gpu_oneshot.sh OUT_DIR`` (docs/gpu.md) runs this once per pair;
- ``--device cpu``: the SmolLM2 pair (135M / 1.7B, Llama) in bf16 and float32, our engine as the params'
  ``engine:`` block runs it (``--forward params``) and eager, against the measured read bandwidth (docs/results.md);
- ``--pairs embedded --hf-forward``: the pipeline's own architectures, the lean forward against the HF modules'.

Variants and their timing: ``bench/speed_measure.py``; models, bytes, the report, ratios and targets:
``bench/speed_report.py``. ``--plan``: what the command compiles and captures and how long it takes, without building
a model (exit 1 over ``--time-budget``). ``--recompute a.json,b.json``: merge runs of one device, re-derive every
ratio from the raw reps. ``--tiny``: tiny models, the fixed-shape steps traced (``aot_eager``), every code path.

Peers in environments of their own (``--llama-cpp-python``, ``--vllm-python``) run this file with that environment's
Python, ``PYTHON bench/speed.py peer {llama_cpp,vllm} DIR`` (only the standard library is imported before), from the
same random weights: llama.cpp from a GGUF file written here (the tensors as llama.cpp's converter writes them,
``speed_measure.gguf_arrays``) and from its copies quantized by llama.cpp's own quantizer (``--llama-cpp-quants``:
what CPU users run), through its batch API at every batch; vLLM's CPU backend from an HF directory. Each prints one
JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any


# --------------------------------------------------------------------------- peers, in environments of their own
def write_gguf(src: Path, out: Path) -> None:
    import gguf
    import numpy as np

    cfg = json.loads((src / "config.json").read_text())
    bf16 = cfg["dtype"] == "bf16"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    n = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.NORMAL] * n)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for path in sorted(src.glob("*.npy")):
        arr = np.load(path)
        kind = gguf.GGMLQuantizationType.BF16 if bf16 and arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32 and arr.dtype == np.uint16:  # norms: bf16 bits -> f32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        w.add_tensor(path.stem, arr, raw_dtype=kind if kind == gguf.GGMLQuantizationType.BF16 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def time_llama_cpp(src: Path) -> dict:
    """llama.cpp decoding ``cfg["batch"]`` rows greedily from the GGUF file written from ``src`` (in the model's
    dtype), then from that file quantized by llama.cpp's own quantizer to each of ``cfg["quants"]`` (``Q8_0``,
    ``Q4_K_M``, ...). Files already in ``src`` are reused: the bench keeps the directory across batches, so a model is
    written and quantized once. The quantized runs come under ``quantized``, by lower-case type name."""
    import llama_cpp

    cfg = json.loads((src / "config.json").read_text())
    log = _LlamaLog(llama_cpp)
    llama_cpp.llama_backend_init()
    gguf_path = src / "model.gguf"
    if not gguf_path.exists():
        write_gguf(src, gguf_path)
    out = {**_llama_cpp_greedy(llama_cpp, gguf_path, cfg), "precision": cfg["dtype"],
           "system_info": llama_cpp.llama_print_system_info().decode().strip()}  # fmt: skip
    out["quantized"] = {}
    for q in cfg.get("quants", []):
        path, meta = src / f"model-{q.lower()}.gguf", src / f"model-{q.lower()}.json"
        if not meta.exists():
            meta.write_text(json.dumps(quantize_gguf(llama_cpp, gguf_path, path, q, cfg["threads"], log)))
        out["quantized"][q.lower()] = {
            **_llama_cpp_greedy(llama_cpp, path, cfg),
            **json.loads(meta.read_text()),
        }
    return out


class _LlamaLog:
    """llama.cpp's log lines (its own callback prints them all to stderr): the warnings kept, for the quantizer's
    fallbacks to reach the report."""

    def __init__(self, llama_cpp: Any) -> None:
        self.text: list[str] = []
        self._last = 0

        def keep(level: int, text: bytes, _: Any) -> None:
            # ggml.h's ggml_log_level: 3 WARN, 4 ERROR, 5 CONT (continues the line before); not llama_cpp._logger's
            # older numbering
            level = self._last if level == 5 else level
            self._last = level
            if level in (3, 4):
                self.text.append(text.decode("utf-8", "replace"))

        self._cb = llama_cpp.llama_log_callback(keep)  # held: llama.cpp keeps only the pointer
        llama_cpp.llama_log_set(self._cb, None)

    def take(self) -> list[str]:
        """The warning and error lines logged since the last call."""
        lines = [" ".join(x.split()) for x in "".join(self.text).splitlines() if x.strip()]
        self.text.clear()
        return lines


def quantize_gguf(llama_cpp: Any, src: Path, out: Path, qtype: str, threads: int, log: _LlamaLog) -> dict:
    """``src`` quantized to ``qtype`` (a ``LLAMA_FTYPE_MOSTLY_*`` name) by ``llama_model_quantize``, llama.cpp's
    rules for which tensor gets which type included: the seconds, the tensors' types as written, the bytes a decode
    call reads, and llama.cpp's warnings (tensors whose rows do not fit a type's blocks fall back to another)."""
    import gguf

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise ValueError(f"llama_cpp {llama_cpp.__version__} has no LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    log.take()
    t = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    secs = time.perf_counter() - t
    warnings = log.take()
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {qtype}: returned {rc}; {warnings[-1:]}")
    types: dict[str, int] = {}
    tensors = gguf.GGUFReader(str(out)).tensors
    for x in tensors:
        types[x.tensor_type.name] = types.get(x.tensor_type.name, 0) + 1
    names = {x.name for x in tensors}
    # what a decode call reads: every tensor but an untied input embedding (rows looked up, as ModelCost counts)
    read = sum(
        int(x.n_bytes) for x in tensors if x.name != "token_embd.weight" or "output.weight" not in names
    )
    fallbacks = [w for w in warnings if "falling back" in w or "fallback" in w]
    return {"quantize_s": round(secs, 2), "file_bytes": out.stat().st_size, "weight_bytes": read,
            "tensor_types": dict(sorted(types.items())), "quantize_fallbacks": fallbacks,
            "quantize_warnings": [w for w in warnings if w not in fallbacks]}  # fmt: skip


def _llama_cpp_greedy(llama_cpp: Any, path: Path, cfg: dict) -> dict:
    """Greedy decoding of ``cfg["batch"]`` random prompts of ``prompt_len`` ids, ``new_tokens`` each, with llama.cpp's
    batch API: one sequence id per row, every row's prompt in one prefill batch, then every row's next token in one
    batch per step (the prefill's logits give the first token, as every other row counts). Context settings are
    llama.cpp's defaults but for sizes and threads. A warm-up and ``reps`` timed runs, the last run's tokens."""
    import numpy as np

    lc, batch = llama_cpp, int(cfg["batch"])
    n_prompt, n_new, vocab = cfg["prompt_len"], cfg["new_tokens"], cfg["vocab_size"]
    prompts = np.random.default_rng(0).integers(3, vocab, (batch, n_prompt))  # row 0: the batch-1 prompt
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path.name}")
    cp = lc.llama_context_default_params()
    cp.n_ctx = batch * (n_prompt + n_new + 8)
    cp.n_batch = batch * n_prompt
    cp.n_ubatch = min(cp.n_batch, 512)
    cp.n_seq_max = batch
    cp.n_threads = cp.n_threads_batch = cfg["threads"]
    ctx = lc.llama_init_from_model(model, cp)
    pre, step = lc.llama_batch_init(batch * n_prompt, 0, 1), lc.llama_batch_init(batch, 0, 1)
    try:
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {path.name}")
        pre.n_tokens, step.n_tokens = batch * n_prompt, batch
        for s in range(batch):
            for p in range(n_prompt):
                i = s * n_prompt + p
                pre.token[i], pre.pos[i], pre.n_seq_id[i], pre.seq_id[i][0] = int(prompts[s, p]), p, 1, s
                pre.logits[i] = p == n_prompt - 1
            step.n_seq_id[s], step.seq_id[s][0], step.logits[s] = 1, s, True
        tokens = np.zeros((batch, n_new), dtype=np.int64)

        def decode(b: Any) -> np.ndarray:
            rc = lc.llama_decode(ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(batch, vocab)).argmax(-1)

        def once() -> None:
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            tokens[:, 0] = decode(pre)
            for t in range(1, n_new):
                for s in range(batch):
                    step.token[s], step.pos[s] = int(tokens[s, t - 1]), n_prompt + t - 1
                tokens[:, t] = decode(step)

        out = _walls(once, cfg["reps"], "llama_cpp")
    finally:
        lc.llama_batch_free(pre)
        lc.llama_batch_free(step)
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {**out, "tokens": tokens.tolist(), "flash_attn": "llama.cpp default (auto)"}


def _walls(once: Any, reps: int, package: str) -> dict:
    """A warm-up, then ``reps`` timed runs of ``once()``, and the peer's version."""
    walls = []
    for _ in range(1 + reps):
        t = time.perf_counter()
        once()
        walls.append(time.perf_counter() - t)
    return {"reps_s": walls[1:], "warmup_s": walls[0], "version": __import__(package).__version__}


def time_vllm(src: Path) -> dict:
    """vLLM's CPU backend decoding the HF model directory ``src/hf`` (saved by the bench), ``batch`` rows of random
    prompt ids, greedy, no EOS: the rows' wall times, the first run a warm-up."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads((src / "config.json").read_text())
    llm = LLM(model=str(src / "hf"), dtype=cfg["dtype_name"], skip_tokenizer_init=True, seed=0,
              max_model_len=cfg["prompt_len"] + cfg["new_tokens"] + 8, max_num_seqs=max(cfg["batch"], 1))  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in rng.integers(3, cfg["vocab_size"], cfg["prompt_len"])])
               for _ in range(cfg["batch"])]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=cfg["new_tokens"], ignore_eos=True, detokenize=False)
    return _walls(lambda: llm.generate(prompts, params, use_tqdm=False), cfg["reps"], "vllm")


PEERS = {"llama_cpp": time_llama_cpp, "vllm": time_vllm}
if __name__ == "__main__" and sys.argv[1:2] == ["peer"]:
    if len(sys.argv) != 4 or sys.argv[2] not in PEERS:
        raise SystemExit(f"usage: PYTHON bench/speed.py peer {{{','.join(PEERS)}}} DIR")
    print(json.dumps(PEERS[sys.argv[2]](Path(sys.argv[3]))), flush=True)
    raise SystemExit(0)

ROOT = Path(__file__).resolve().parents[1]
# A citer already on the path (PYTHONPATH: e.g. a pinned copy of one commit) wins over this checkout's.
if importlib.util.find_spec("citer") is None:
    sys.path.insert(0, str(ROOT))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from citer.ops.openmp import set_wait_env  # noqa: E402

set_wait_env()  # before torch loads libgomp: the wait policy `citer route` runs with

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.speed_measure import engine_block, forward_compiles, measure, peer_missing  # noqa: E402
from bench.speed_report import (  # noqa: E402
    DTYPES,
    PAIRS,
    SPECS,
    BenchRun,
    build_pair,
    cpu_precision,
    derive_timings,
    gpu_name,
    n_params,
    recompute,
    spec_params,
    sync,
    targets,
)
from citer.decoding.cost import GPU_BANDWIDTH  # noqa: E402


def run_pairs(args: argparse.Namespace) -> int:
    """Every pair and dtype of the command within the time budget (batches in order), then the targets."""
    run = BenchRun(args)
    if args.llama_cpp_python and (why := peer_missing(args.llama_cpp_python, "import llama_cpp, gguf")):
        run.note(f"llama.cpp rows skipped: {why}")
        args.llama_cpp_python, args.llama_cpp_quants, args.llama_cpp_batches = "", [], []
        run.report["settings"].update(llama_cpp_python="", llama_cpp_quants=[], llama_cpp_batches=[])
    elif not args.llama_cpp_python and args.device == "cpu":
        run.note("llama.cpp rows skipped: no --llama-cpp-python")
    types = "; ".join(f"llama_cpp.LLAMA_FTYPE_MOSTLY_{q}" for q in args.llama_cpp_quants)
    if types and (why := peer_missing(args.llama_cpp_python, f"import llama_cpp; {types}")):
        raise SystemExit(f"--llama-cpp-quants: {why}")
    print(f"device: {run.report['device']['name']}; torch {torch.__version__}; bandwidth limit "
          f"{run.bandwidth / 1e9:.1f} GB/s ({run.report['bandwidth']['source']}); load {run.report['host'].get('loadavg_1m')}",
          flush=True)  # fmt: skip
    run.save()
    for pair in args.pairs:
        for dtype in args.dtypes:
            if run.left() < 30:
                run.note(f"{pair} {dtype}: skipped, time budget spent")
                continue
            try:
                t = time.perf_counter()
                models = build_pair(pair, args.device, dtype)
                sync(args.device)
                info = run.report["pairs"].setdefault(pair, {"slm": PAIRS[pair][0], "llm": PAIRS[pair][1]})
                info.update(slm_params=n_params(models.slm), llm_params=n_params(models.llm),
                            slm_weight_bytes_per_call={**info.get("slm_weight_bytes_per_call", {}), dtype: models.costs[0].weight_bytes},
                            llm_weight_bytes_per_call={**info.get("llm_weight_bytes_per_call", {}), dtype: models.costs[1].weight_bytes})  # fmt: skip
                info.setdefault("build_s", {})[dtype] = round(time.perf_counter() - t, 1)
                run.save()
                with torch.inference_mode():
                    for batch in args.batches:
                        if run.left() < 30:
                            run.note(f"{pair} {dtype} batch {batch}: skipped, time budget spent")
                            continue
                        measure(run, models, batch)
                        derive_timings(run.report, args.stat)
                        run.save()
            except Exception as exc:
                run.error(f"{pair} {dtype}", exc)
            finally:
                # Compiled code holds its models' weights (guards, constants) until dynamo forgets it: without the
                # reset the next dtype's pair is built beside this one (an OOM kill here at SmolLM2 fp32).
                models = None
                run.drop_scratch()
                torch._dynamo.reset()
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            run.save()
    derive_timings(run.report, args.stat)
    run.report["targets"] = targets(run.report)
    run.save()
    print(json.dumps(run.report["targets"], indent=1, default=float))
    print(f"wrote {args.out} in {run.elapsed():.0f}s", flush=True)
    return 0


# -------------------------------------------------------------------------------------------------------- the plan
# Seconds per phase where no report of the same device kind says better (docs/gpu.md). Compiles: a regional piece of
# our engine (a layer; the head is smaller), a whole step on a CPU (per 24 layers), and transformers' whole-model
# compile (the first GPU run, engine at 14c6662: 39-58 s for Qwen2-7B and 49 s for Qwen2.5-14B, first call included:
# about 25 s + 0.5 s a layer). Steps: our engine at 1.5x its bytes plus 0.3 ms; transformers eager, host-bound, at
# ~0.9 ms a layer per step; transformers compiled at 2.4x its bytes (the same run).
PLAN_DEFAULTS: dict[str, dict[str, float]] = {
    "cuda": {"start_s": 12, "build_gb_per_s": 5.0, "layer_compile_s": 15, "head_compile_s": 6, "whole_compile_s": 45,
             "hf_compile_s": 25, "hf_compile_per_layer_s": 0.5, "capture_s": 0.1, "engine_bw_factor": 1.5,
             "engine_step_s": 3e-4, "hf_layer_step_s": 9e-4, "hf_compiled_bw_factor": 2.4, "tests_s": 130},
    "cpu": {"start_s": 10, "build_gb_per_s": 1.0, "layer_compile_s": 8, "head_compile_s": 4, "whole_compile_s": 55,
            "hf_compile_s": 90, "hf_compile_per_layer_s": 2.0, "capture_s": 0.0, "engine_bw_factor": 1.4,
            "engine_step_s": 1e-3, "hf_layer_step_s": 3e-4, "hf_compiled_bw_factor": 1.5, "tests_s": 0},
}  # fmt: skip


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What the command will do, from shapes and ``PLAN_DEFAULTS`` (or the measured seconds of the last committed
    report of the same device kind): compiles and captures per model, and seconds per phase."""
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    k = dict(PLAN_DEFAULTS[dev])
    k.update(_measured_constants(dev))
    bw = GPU_BANDWIDTH[args.gpu] if args.gpu else 20e9
    phases: dict[str, float] = {"start": k["start_s"]}
    compiles: dict[str, int] = {}
    captures = 0
    n_new = args.new_tokens
    runs = 1 + args.reps  # warm-up and timed reps
    for pair in args.pairs:
        slm, llm = PAIRS[pair]
        for dtype in args.dtypes:
            size = DTYPES[dtype].itemsize
            wb = {m: spec_params(m) * size for m in (slm, llm)}
            layers = {m: SPECS[m]["layers"] for m in (slm, llm)}
            phases["build"] = phases.get("build", 0) + (wb[slm] + wb[llm]) / 1e9 / k["build_gb_per_s"]
            # Our compiles: regional pieces (layer, head) per model; with --forward compiled the ragged forward's graphs,
            # priced as whole-model graphs (a step kind, and a catch-up kind for a model that is caught up): a rough
            # guess, as it compiles a few per call kind and pool shape.
            mode = args.forward
            regional = mode in ("graphs", "aot_eager")
            for m, kinds in ((slm, 1), (llm, 2)):
                n = 0 if not forward_compiles(mode) else 2 if regional else kinds
                compiles[f"{m} ({dtype})"] = n
                if regional:
                    secs = k["layer_compile_s"] + k["head_compile_s"]
                else:
                    secs = n * k["whole_compile_s"] * layers[m] / 24
                phases["compile_engine"] = phases.get("compile_engine", 0) + secs
            for b in args.batches:
                bb = 1 << max(b - 1, 0).bit_length()
                t_llm = k["engine_bw_factor"] * wb[llm] / bw + k["engine_step_s"]
                t_slm = k["engine_bw_factor"] * wb[slm] / bw + k["engine_step_s"]
                steps = n_new
                n_routed = len(args.fractions) + (
                    2 * len(args.fractions) + 2 * len(args.overlap_fractions) if b > 1 else 0
                )
                if mode == "graphs" and dev == "cuda":
                    # per engine: its SLM step bucket, and (routed) catch-up buckets: rows x tokens up to 16
                    caps = 2 + n_routed * (1 + bb.bit_length() * 5)
                    captures += caps
                    phases["captures"] = phases.get("captures", 0) + caps * k["capture_s"]
                eng = runs * steps * (t_llm + t_slm + n_routed * (t_slm + 0.1 * t_llm * max(1, b // 4)))
                eng *= 2 if args.hf_forward else 1
                hf_step = max(layers[llm] * k["hf_layer_step_s"], wb[llm] / bw)
                hf = runs * steps * hf_step
                if args.compile and b in args.compile_batches:
                    compiles[f"hf {llm} ({dtype}) b{b}"] = 1
                    hf_compile = k["hf_compile_s"] + layers[llm] * k["hf_compile_per_layer_s"]
                    phases["compile_hf"] = phases.get("compile_hf", 0) + hf_compile
                    hf += runs * steps * k["hf_compiled_bw_factor"] * wb[llm] / bw
                if b == 1:  # assisted: ~0.3 verification calls per token
                    hf += len(args.alphas) * runs * steps * 0.35 * hf_step
                phases["measure"] = phases.get("measure", 0) + eng + hf
    total = sum(phases.values())
    return {"compiles_per_model": compiles, "captures": captures, "phases_s": {p: round(s, 1) for p, s in phases.items()},
            "estimated_device_s": round(total, 1), "time_budget_s": args.time_budget, "source": k.get("source", "defaults")}  # fmt: skip


def _committed_rows(dev: str) -> tuple[Path, list[dict[str, Any]]]:
    """The committed report of this device kind (``cuda`` or ``cpu``) and its rows (none where it is absent)."""
    path = ROOT / "reports" / ("bench_gpu.json" if dev == "cuda" else "bench_cpu.json")
    try:
        return path, json.loads(path.read_text()).get("rows", [])
    except (OSError, ValueError):
        return path, []


def _measured_constants(dev: str) -> dict[str, Any]:
    """Per-piece compile seconds from the last committed report of this device kind, when it recorded them."""
    path, rows = _committed_rows(dev)
    layer: list[float] = []  # seconds per regional compile (--forward graphs or aot_eager)
    out: dict[str, Any] = {}
    for r in rows:
        # "static_steps": reports made before the engine's one forward setting
        if r.get("engine_forward", r.get("static_steps")) not in ("graphs", "aot_eager"):
            continue
        for m in ("slm", "llm"):
            if r.get(f"{m}_compiles") and r.get(f"{m}_compile_s"):
                layer.append(r[f"{m}_compile_s"] / r[f"{m}_compiles"])
    # a model's two pieces, layer and head, averaged in the report: the split kept from the defaults
    if layer:
        out["layer_compile_s"] = 0.7 * 2 * max(layer)
        out["head_compile_s"] = 0.3 * 2 * max(layer)
    if out:
        out["source"] = f"{path.relative_to(ROOT)} (measured compiles)"
    return out


def _measured_reserve() -> float | None:
    """Seconds to keep for a compiling warm-up on a GPU: 1.5x the longest such warm-up in the committed GPU report
    (at least 20 s), or None where it measured none."""
    warm = [r["warmup_s"] for r in _committed_rows("cuda")[1] if r.get("compiles") and r.get("warmup_s")]
    return max(20.0, 1.5 * max(warm)) if warm else None


def print_plan(p: dict[str, Any]) -> None:
    width = max(len(x) for x in p["phases_s"])
    for name, s in p["phases_s"].items():
        print(f"  {name:<{width}} {s:8.1f} s")
    print(
        f"  {'total':<{width}} {p['estimated_device_s']:8.1f} s (budget {p['time_budget_s']:.0f} s; {p['source']})"
    )
    for m, n in p["compiles_per_model"].items():
        print(f"  compiles {m}: {n}")
    print(f"  captures (upper bound): {p['captures']}")


def plan_script(runs: list[str], tests: bool) -> int:
    """The whole one-shot script's plan: each run's, plus the CUDA tests; the last line is one JSON object."""
    total: dict[str, Any] = {"compiles_per_model": {}, "captures": 0, "estimated_device_s": 0.0, "runs": []}
    ok = True
    for r in runs:
        args = parse_args(shlex.split(r), plan_only=True)
        p = plan(args)
        print(f"run: bench/speed.py {r}")
        print_plan(p)
        ok &= p["estimated_device_s"] <= args.time_budget
        total["runs"].append({"args": r, **p})
        for m, n in p["compiles_per_model"].items():
            total["compiles_per_model"][m] = max(total["compiles_per_model"].get(m, 0), n)
        total["captures"] += p["captures"]
        total["estimated_device_s"] += p["estimated_device_s"]
    if tests:
        t = PLAN_DEFAULTS["cuda"]["tests_s"]
        print(f"CUDA tests (tests/gpu): {t:.0f} s")
        total["estimated_device_s"] += t
    total["estimated_device_s"] = round(total["estimated_device_s"], 1)
    print(json.dumps({k: v for k, v in total.items() if k != "runs"}))
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------- arguments
def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None, plan_only: bool = False) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--pairs", default="", help=f"comma list of {sorted(PAIRS)} (default: per device)")
    ap.add_argument(
        "--dtypes",
        default="",
        help="bf16,fp32 (default: bf16 on cuda; on cpu both, the CPU's winning one first)",
    )
    ap.add_argument("--batches", type=_ints, default=None, help="default: 1,32 on cuda, 1,8 on cpu")
    ap.add_argument("--fractions", type=_floats, default=[0.1], help="random router LLM probabilities")
    ap.add_argument("--overlap-fractions", type=_floats, default=None,
                    help="overlap_f{p} rows at batch > 1 (default 0.1 on cpu, none on cuda: captured steps do not "
                    "overlap there, docs/gpu.md)")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 on cuda, 32 on cpu")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per variant")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="over the timed reps")
    ap.add_argument("--min-rows", type=int, default=0, help="shared: llm_min_rows (0: max(2, batch // 4))")
    ap.add_argument("--max-wait-steps", type=int, default=4, help="shared: llm_max_wait_steps")
    ap.add_argument("--alphas", type=_floats, default=None, help="assisted: forced agreement rates")
    ap.add_argument("--draft-tokens", type=int, default=5, help="assisted: draft length per call")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="transformers' static cache + compile baseline (default: on; off with --quick)")  # fmt: skip
    ap.add_argument("--compile-batches", type=_ints, default=None, help="batches of the compiled HF baseline")
    ap.add_argument("--compile-reserve", type=float, default=None, help="skip a compile with fewer s left")
    ap.add_argument("--engine-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="also our engine without compiles (default: on for cpu)")  # fmt: skip
    ap.add_argument("--hf-forward", action="store_true", help="engine rows also through the HF forward")
    ap.add_argument("--llama-cpp-python", default="",
                    help="a Python with llama-cpp-python and gguf: llama.cpp rows from the same weights")  # fmt: skip
    ap.add_argument("--llama-cpp-quants", default=None,
                    help="llama.cpp also at these types, quantized by its own quantizer (LLAMA_FTYPE_MOSTLY_* names; "
                    "default Q8_0,Q4_K_M,Q4_0; none: the model's dtype only)")  # fmt: skip
    ap.add_argument(
        "--llama-cpp-batches", type=_ints, default=None, help="llama.cpp rows' batches (default: all)"
    )
    ap.add_argument("--vllm-python", default="", help="a Python with vllm (CPU backend): vLLM LLM-only rows")
    ap.add_argument("--forward", default="auto",
                    help="how the engines' calls run (citer.decoding.runner.FORWARDS), replacing the --params engine "
                    "block's; auto: graphs on cuda, aot_eager with --tiny, else params: the block's own, as citer "
                    "route runs it")  # fmt: skip
    ap.add_argument(
        "--params",
        default=str(ROOT / "params.yaml"),
        help="the params whose engine: block the engines are built from (engine_from_block, as citer route)",
    )
    ap.add_argument("--gpu", default="auto", help=f"bandwidth limit: one of {sorted(GPU_BANDWIDTH)}")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; later measurements are skipped (default: 480 on cuda or with --quick, 3600 on cpu)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run of every path")
    ap.add_argument("--quick", action="store_true",
                    help="cpu: one rep, the CPU's winning precision (bf16 with bf16 products, else fp32), no transformers compile (a rerun of the headline in <= 8 min)")  # fmt: skip
    ap.add_argument("--plan", action="store_true", help="print what the run compiles and how long it takes")
    ap.add_argument("--plan-script", nargs="+", default=None, metavar="ARGS",
                    help="the plan of several runs (each one quoted argument string) plus the CUDA tests")  # fmt: skip
    ap.add_argument("--recompute", default="", help="result files a,b: merge, re-derive, write --out")
    ap.add_argument("--threads", type=int, default=0, help="cpu: torch threads (0: torch's default)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda" and not a.tiny
    if a.tiny:
        a.device = "cpu"
    a.pairs = [p for p in a.pairs.split(",") if p] or (
        ["tiny"] if a.tiny else ["0.5b-7b"] if cuda else ["smollm2"]
    )
    # A CPU's headline is in the precision that wins there (bf16 needs bf16 products): measured first, and alone
    # with --quick, so a short budget never spends itself on the slow one.
    win = cpu_precision()
    cpu_dtypes = [win] if a.quick else sorted(DTYPES, key=lambda d: d != win)
    a.dtypes = [d for d in a.dtypes.split(",") if d] or (
        ["bf16"] if cuda else ["fp32"] if a.tiny else cpu_dtypes
    )
    a.batches = a.batches or ([1, 32] if cuda else [1, 8])
    a.new_tokens = a.new_tokens or (64 if cuda else 32)
    a.alphas = ([0.9] if cuda or a.quick else [0.5, 0.9]) if a.alphas is None else a.alphas
    a.compile_batches = a.compile_batches or a.batches
    quants = "Q8_0,Q4_K_M,Q4_0" if a.llama_cpp_quants is None else a.llama_cpp_quants
    a.llama_cpp_quants = [
        q.strip().upper() for q in quants.split(",") if q.strip().lower() not in ("", "none")
    ]
    if any(not q.replace("_", "").isalnum() for q in a.llama_cpp_quants):
        ap.error(f"--llama-cpp-quants {quants!r}: LLAMA_FTYPE_MOSTLY_* names, e.g. Q8_0,Q4_K_M,Q4_0")
    a.llama_cpp_batches = (a.llama_cpp_batches or a.batches) if a.llama_cpp_python else []
    if not a.llama_cpp_python:
        a.llama_cpp_quants = []
    if a.overlap_fractions is None:
        a.overlap_fractions = [] if cuda else [0.1]
    if a.compile_reserve is None:
        a.compile_reserve = (_measured_reserve() or 90.0) if cuda else 150.0
    a.engine_eager = (not cuda) if a.engine_eager is None else a.engine_eager
    a.compile = not a.quick if a.compile is None else a.compile
    if a.quick:
        # One timed rep after the warm-up: in float32 on two AVX2 cores, two reps of batch 1 took 208 s of the 360
        # and left batch 8 unmeasured.
        a.reps = min(a.reps, 1)
    if a.time_budget is None:
        # --quick on a CPU: 8 min, so an AVX2 CPU's float32 run times batch 8's baselines (6 min did not).
        a.time_budget = 480 if cuda or a.quick else 3600
    if a.forward == "auto":
        a.forward = "aot_eager" if a.tiny else "graphs" if cuda else "params"
    if a.forward == "params":  # the block's own, so the plan and the baselines see the mode that runs
        a.forward = engine_block(Path(a.params)).get("forward", "eager")
    if a.forward == "eager":
        a.engine_eager = False  # engine_llm is then the eager engine itself
    if a.tiny:
        a.compile = False  # transformers' compile takes minutes; the tiny run checks our paths
    bad = [p for p in a.pairs if p not in PAIRS] + [d for d in a.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown pairs or dtypes {bad}; pairs: {sorted(PAIRS)}, dtypes: {sorted(DTYPES)}")
    if a.gpu == "auto":
        a.gpu = gpu_name(a.device) if cuda and torch.cuda.is_available() else "H100" if cuda else None
    elif a.gpu not in GPU_BANDWIDTH:
        ap.error(f"--gpu {a.gpu!r}: one of {sorted(GPU_BANDWIDTH)}")
    if cuda and a.gpu is None:
        ap.error(
            f"GPU {torch.cuda.get_device_name(0)!r} not in {sorted(GPU_BANDWIDTH)}: name its bandwidth with --gpu"
        )
    if not (plan_only or a.plan or a.plan_script or a.recompute):
        if cuda and not torch.cuda.is_available():
            ap.error("no CUDA device; use --device cpu, or --tiny for a smoke run")
        if not a.out:
            ap.error(
                "--out PATH is required (on a lent GPU: a file under the output directory that comes back)"
            )
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.plan_script:
        return plan_script(args.plan_script, tests=True)
    if args.plan:
        p = plan(args)
        print_plan(p)
        print(json.dumps(p))
        return 0 if p["estimated_device_s"] <= args.time_budget else 1
    if args.recompute:
        merged = recompute([f for f in args.recompute.split(",") if f], args.stat, args.out)
        print(json.dumps(merged["targets"], indent=1, default=float))
        _stamp(args)
        print(f"wrote {args.out} ({len(merged['rows'])} rows, stat {args.stat})")
        return 0
    torch.manual_seed(0)
    code = run_pairs(args)
    _stamp(args)
    return code


def _stamp(args: argparse.Namespace) -> None:
    """Provenance for a report written into the checkout's reports/ (not on a lent GPU, whose output directory is
    copied back and stamped when merged here)."""
    out = Path(args.out).resolve()
    if out.parent.name == "reports" and out.parent.parent == ROOT:
        from citer.tracking.provenance import stamp_bench

        stamp_bench(out, "speed", args, 0.0)


if __name__ == "__main__":
    raise SystemExit(main())
