"""The bench reports' docs blocks: one renderer per ``bench/*.py`` report (speed, labels, serving, roofline, llama.cpp's
routed pairs, the CPU linear kernels, the real model's agreement, the precision sweep, the pipeline's load), each a
table and a note naming the report it read; per-CPU reports take the report's name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from citer.evaluation.tables import Block, ci, load_report, table


def speed_block(reports: Path, name: str = "bench_cpu.json") -> Block:
    """bench/speed.py: every decoder's tokens/s at real shapes against the bandwidth limit, and the targets."""
    r = load_report(reports, name)
    rows = [[x["pair"], x["dtype"], str(x["batch"]), x["variant"], f"{x['tokens_per_s']:.2f}",
             f"{x['ms_per_token']:.1f}", f"{x['ratio_to_bw']:.2f}",
             "–" if x.get("llm_calls_per_token") is None else f"{x['llm_calls_per_token']:.3f}",
             f"{len(x['reps_s'])}"] for x in r["rows"] if "tokens_per_s" in x]  # fmt: skip
    head = ["pair", "dtype", "batch", "decoder", "tokens/s", "ms/token", "÷ bandwidth limit", "LLM calls/token",
            "reps"]  # fmt: skip
    found = [f"- {pair} `{k}`: {v:.2f}" if isinstance(v, float) else f"- {pair} `{k}`: {v}"
             for pair, t in r["targets"].items() for k, v in t.items()]  # fmt: skip
    runs = {x.get("run") for x in r["rows"] if "tokens_per_s" in x}
    if len(runs) > 1:  # merged runs (one process per pair and batch): a batch two runs measured shows both
        head.append("run")
        for row, x in zip(rows, [x for x in r["rows"] if "tokens_per_s" in x], strict=True):
            row.append(str(x.get("run", "")))
    host = r.get("host", {})
    source = r["bandwidth"].get("source", "")
    source = "measured in the run" if source.startswith("measured") else source
    where = (f"{r['device']['name']}, bandwidth limit {r['bandwidth']['limit_bytes_per_s'] / 1e9:.1f} GB/s {source}, "
             f"torch {r.get('torch')}, {r.get('stat', 'median')} of the reps, other processes' share of the cores during the run {host.get('others_cpu_share')}")  # fmt: skip
    return table(head, rows) + "\n\nTargets:\n" + "\n".join(
        found
    ) + f"\n\nFrom `reports/{name}` ({where}).", [name]


def labels_block(reports: Path) -> Block:
    """bench/labels.py: teacher-forced label collection against the reference's per-token generate loop."""
    r = load_report(reports, "bench_labels.json")
    rows = [
        ["citer, teacher-forced (one pass per model)", f"{r['citer_seconds']:.3f} s"],
        ["per-token generate loop (the reference's method)", f"{r['per_token_loop_seconds']:.3f} s"],
        ["speed-up", f"{r['speedup']:.0f}×"],
        [
            f"whole iteration 1 incl. {r['n_rollouts']} rollouts, citer vs reference (estimated)",
            f"{r['citer_collect_iter1_seconds']:.2f} s vs {r['reference_iter1_estimated_seconds']:.1f} s",
        ],  # fmt: skip
    ]
    note = f"{r['n_examples']} examples, {r['n_tokens']} tokens, {r['models']}"
    return table(["", "measured"], rows) + f"\n\nFrom `reports/bench_labels.json` ({note}).", [
        "bench_labels.json"
    ]


def serving_block(reports: Path) -> Block:
    """bench/serving.py: the real servers under 1/8/32 streaming clients."""
    r = load_report(reports, "bench_serving.json")
    rows = [[x["server"], str(x["clients"]), f"{x['tokens_per_s']:.0f}", f"{x['p50_latency_s']:.3f}",
             f"{x['p99_latency_s']:.3f}", f"{x['p50_ttft_s']:.3f}", f"{x['ttft_over_latency']:.2f}",
             str(x["lost"]), str(x["differ_from_alone"])] for x in r["rows"]]  # fmt: skip
    head = ["server", "clients", "tokens/s", "p50 latency s", "p99 latency s", "p50 TTFT s", "TTFT / latency",
            "lost", "differ from alone"]  # fmt: skip
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in r.get("ratios", {}).items() if isinstance(v, int | float))
    return table(head, rows) + f"\n\nRatios: {ratios}. From `reports/bench_serving.json`.", [
        "bench_serving.json"
    ]


def _at_calls(x: dict[str, Any]) -> str:
    """The ceiling with each of the routed run's LLM calls but one paying a weight pass (older reports: "–")."""
    if "ceiling_at_calls" not in x:
        return "–"
    return f"{x['ceiling_at_calls']:.2f}× ({x['routed_llm_calls']} calls, a pass {x['llm_row_step_s']:.3f} s)"


def _streamed(x: dict[str, Any]) -> str:
    """Routed over LLM-only with ``stream_rows`` prompts through max_rows = batch, as citer route decodes a dataset
    (older reports: "–")."""
    if "stream_measured" not in x:
        return "–"
    return f"{x['stream_measured']:.2f}× ({x['stream_rows']} prompts)"


def roofline_block(reports: Path, name: str = "bench_roofline.json") -> Block:
    """bench/roofline.py (the Xeon's, and one report per other CPU kind): per batch, the ceiling the LLM's
    unskippable compute puts on routing, beside the measured."""
    r = load_report(reports, name)
    rows = [[str(x["batch"]), f"{x['llm_s']:.2f} s", f"{x['llm_prefill_share']:.0%}", f"{x['slm_s']:.2f} s",
             f"{x['routed_s']:.2f} s", f"{x['routed_llm_prompt_tokens'] + x['routed_llm_catchup_tokens']}",
             f"{x['llm_tokens_per_s_prefill']:.0f}", f"{x['measured']:.2f}×", f"{x['ceiling']:.2f}×",
             _at_calls(x), f"{x['decode_ceiling']:.2f}×", _streamed(x)] for x in r["rows"]]  # fmt: skip
    head = ["batch", "LLM alone", "its prompt share", "SLM alone", "routed", "tokens the LLM read",
            "LLM tokens/s (prompt)", "measured", "ceiling", "ceiling at its LLM calls", "ceiling without prompts",
            "measured, a stream through max_rows = batch"]  # fmt: skip
    note = (f"{r['pair']} shapes, {r['dtype']}, prompt {r['prompt_len']}, {r['new_tokens']} new tokens, f = "
            f"{r['fraction']}, engine {r['engine']}, median of {r['reps']}; {r['cpu']}, {r['threads']} threads, "
            f"torch {r['torch']}, other processes' share of the cores {r['others_cpu_share']}")  # fmt: skip
    out = table(head, rows)
    # Other engine settings timed in the same run (``--variants``), beside the params' own (first line per batch).
    alt = [[str(x["batch"]), name, f"{v['routed_s']:.2f} s", f"{v['measured']:.2f}×", f"{v['same_rows']:.0%}",
            f"{v['llm_calls_per_step']:.2f}"]
           for x in r["rows"] for name, v in [("params' engine", {"routed_s": x["routed_s"], "measured": x["measured"],
                                               "same_rows": 1.0, "llm_calls_per_step": x["routed_llm_calls_per_step"]}),
                                              *x.get("variants", {}).items()]] if any(x.get("variants") for x in r["rows"]) else []  # fmt: skip
    if alt:
        out += "\n\n" + table(["batch", "routed engine", "routed", "measured", "rows as the params' engine's",
                                "LLM calls a step"], alt)  # fmt: skip
    return out + f"\n\nFrom `reports/{name}` ({note}).", [name]


def _shared_cell(row: dict[str, Any], best: float) -> str:
    """The shared-call run over the batch's best LLM-only decoder, with its tokens' agreement with calling at once
    where the report has it."""
    if "routed_shared_tok_s" not in row:
        return "–"
    cell = f"{row['routed_shared_tok_s'] / best:.2f}×"
    if "routed_shared_agreement" in row:
        same = (
            math.floor(row["routed_shared_agreement"] * 1000) / 10
        )  # floored: 99.9%, never a rounded-up 100%
        cell += f" ({same:g}% same tokens)"
    return cell


def llama_cpp_routed_block(reports: Path, name: str = "bench_cpu_llama_cpp_routed.json") -> Block:
    """bench/llama_cpp_routed.py (one report per CPU kind): routed pairs on llama.cpp's kernels at each precision,
    calling the LLM at once and with the params' shared calls, against the fastest LLM-only decoder of the run at any
    precision, with routing's ceiling beside."""
    r = load_report(reports, name)
    best = {
        b: max(x["llm_only_tok_s"] for x in r["rows"] if x["batch"] == b)
        for b in {x["batch"] for x in r["rows"]}
    }
    shared = {x["batch"]: x.get("routed_shared_tok_s") for x in r["rows"]}
    rows = [[str(x["batch"]), x["precision"], f"{x['llm_only_tok_s']:.1f}", f"{x['slm_only_tok_s']:.0f}",
             f"{x['routed_tok_s']:.1f}", f"{x['routed_over_own_llm']:.2f}×", f"{x['ceiling_over_own_llm']:.2f}×",
             f"{x['routed_tok_s'] / best[x['batch']]:.2f}×",
             _shared_cell(x, best[x["batch"]]),
             f"{x['routed_over_ideal']:.2f}", f"{x['llm_prompt_tok_s']:.0f}"] for x in r["rows"]]  # fmt: skip
    head = ["batch", "SLM + LLM precision", "LLM alone tok/s", "SLM alone tok/s", "routed tok/s",
            "routed ÷ its LLM alone", "ceiling ÷ its LLM alone", "routed ÷ best LLM-only",
            "shared calls ÷ best LLM-only", "routed ÷ step-time ideal", "LLM prompt tok/s"]  # fmt: skip
    if not any(shared.values()):  # reports from before shared calls ran on llama.cpp
        head, rows = head[:8] + head[9:], [x[:8] + x[9:] for x in rows]
    s, d = r["settings"], r["device"]
    # a pair's ceiling over its own LLM alone, rescaled to the batch's fastest LLM-only decoder
    ceil = {b: max(x["ceiling_over_own_llm"] * x["llm_only_tok_s"] / best[b] for x in r["rows"] if x["batch"] == b)
            for b in best}  # fmt: skip
    bests = "; ".join(f"batch {b}: {r['ratios'][f'b{b}_best_llm_only']}, routing's ceiling over it {ceil[b]:.2f}×"
                      for b in sorted(best))  # fmt: skip
    rule = f"; shared calls: {s['shared_call_rule']}" if "shared_call_rule" in s else ""
    note = (f"SmolLM2 shapes ({s['pair']}), prompt {s['prompt_len']}, {s['new_tokens']} new tokens, f = {s['f']}, "
            f"median of {s['reps']}{rule}; {d['cpu']}, {d['threads']} threads, llama-cpp-python "
            f"{r['llama_cpp_python']}; other processes' share of the cores {r['others_cpu_share']}; best LLM-only: "
            f"{bests}")  # fmt: skip
    return table(head, rows) + f"\n\nFrom `reports/{name}` ({note}).", [name]


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def cpu_linear_block(reports: Path, name: str = "bench_cpu_linear.json") -> Block:
    """bench/cpu_linear.py (one report per CPU kind): torch's float32 linear against oneDNN's on a packed weight, per
    weight shape and row count, cold weights, and which of the two ``citer.kernels.cpu_linear`` takes here."""
    r = load_report(reports, name)
    by: dict[str, list[dict[str, Any]]] = {}
    for x in r["rows"]:
        by.setdefault(x["shape"], []).append(x)
    counts = [x["rows"] for x in next(iter(by.values()))]
    rows = []
    for shape, xs in by.items():
        one = xs[0]
        rows.append([f"{shape} ({one['out']} × {one['in']})", "/".join(sorted({x["chosen"] for x in xs})),
                     f"{one['torch_ms']:.3f} / {one['packed_ms']:.3f} ms", f"{one['packed_gb_s']:.1f}",
                     *(f"{x['torch_over_packed']:.2f}×" for x in xs)])  # fmt: skip
    head = ["weight (out × in)", "chosen here", f"{_rows(counts[0])}: torch / packed",
            f"packed GB/s, {_rows(counts[0])}", *(f"torch ÷ packed, {_rows(n)}" for n in counts)]  # fmt: skip
    inv = {k: sum(x["row_invariant"][k] for x in r["rows"]) for k in ("torch", "packed")}
    note = (f"{r['cpu']}, {r['threads']} threads, torch {r['torch']}, bandwidth limit {r['bandwidth_gb_s']:.1f} GB/s "
            f"measured in the run, median of {r['reps']}, cold weights; float32 packed from "
            f"{r['fp32_packed_min']:,} elements here: {r['fp32_packed_here']}; a row's outputs bit for bit the same "
            f"alone and beside the others: torch {inv['torch']}/{len(r['rows'])} calls, packed "
            f"{inv['packed']}/{len(r['rows'])}; other processes' share of the cores {r['others_cpu_share']}")  # fmt: skip
    md = table(head, rows)
    q8 = [c for c in counts if any("int8_bf16_ms" in x for x in r["rows"] if x["rows"] == c)]
    if q8:  # torch's int8 weight-only kernel beside the packed float32 linear (reports since it was timed)
        cells = {(x["shape"], x["rows"]): x for x in r["rows"]}
        md += "\n\n" + table(
            ["weight (out × in)", "int8 weights, float32 activations, 1 row: time ÷ packed float32's",
             *(f"int8 weights, bf16 activations, {_rows(n)}: time ÷ packed float32's" for n in q8)],
            [[f"{shape} ({xs[0]['out']} × {xs[0]['in']})",
              f"{cells[(shape, 1)]['int8_fp32_ms'] / cells[(shape, 1)]['packed_ms']:.2f}×" if (shape, 1) in cells
              else "–",
              *(f"{cells[(shape, n)]['int8_bf16_ms'] / cells[(shape, n)]['packed_ms']:.2f}×" for n in q8)]
             for shape, xs in by.items()],
        )  # fmt: skip
    kc = [c for c in counts if any("kernel_ms" in x for x in r["rows"] if x["rows"] == c)]
    if kc:  # citer's AVX2 kernel beside the packed weight (reports since it was timed)
        cells = {(x["shape"], x["rows"]): x for x in r["rows"]}
        md += "\n\n" + table(
            ["weight (out × in)", "kernel GB/s, 1 row", *(f"packed ÷ kernel, {_rows(n)}" for n in kc)],
            [[f"{shape} ({xs[0]['out']} × {xs[0]['in']})",
              f"{cells[(shape, 1)]['kernel_gb_s']:.1f}" if "kernel_gb_s" in cells.get((shape, 1), {}) else "–",
              *(f"{cells[(shape, n)]['packed_ms'] / cells[(shape, n)]['kernel_ms']:.2f}×"
                if "kernel_ms" in cells.get((shape, n), {}) else "–" for n in kc)]
             for shape, xs in by.items()],
        )  # fmt: skip
        k_rows = [x for x in r["rows"] if "kernel" in x["row_invariant"]]
        note += (f"; the kernel's row 0 bit for bit the same alone and beside the others: "
                 f"{sum(x['row_invariant']['kernel'] for x in k_rows)}/{len(k_rows)} calls")  # fmt: skip
    if r.get("engine_rows"):
        es = r["engine_settings"]
        with_kernel = all("kernel_s" in x for x in r["engine_rows"])
        md += "\n\n" + table(
            ["batch", "engine (citer route's)", *(["kernel"] if with_kernel else []), "torch's linear", "packed",
             *(["packed ÷ kernel"] if with_kernel else []), "torch ÷ packed", "same tokens"],
            [[str(x["batch"]), x["engine"], *([f"{x['kernel_s']:.2f} s"] if with_kernel else []),
              f"{x['torch_s']:.2f} s", f"{x['packed_s']:.2f} s",
              *([f"{x['packed_over_kernel']:.2f}×"] if with_kernel else []), f"{x['torch_over_packed']:.2f}×",
              "yes" if x["same_tokens"] else "no"] for x in r["engine_rows"]],
        )  # fmt: skip
        note += (f"; engines: {es['pair']} shapes in float32, prompt {es['prompt_len']}, {es['new_tokens']} new tokens, "
                 f"routed by a random router at f = {es['f']}, the packed path on and off in turn")  # fmt: skip
    return md + f"\n\nFrom `reports/{name}` ({note}).", [name]


def real_model_agreement_block(reports: Path) -> Block:
    """bench/real_model_agreement.py: each runner and precision against float32 on the real model."""
    r = load_report(reports, "bench_real_model_agreement.json")
    rows = [[x["runner"], x["precision"], f"{x['teacher_forced_agreement']:.1%} ({x['agreeing_tokens']}/{x['tokens']})",
             f"{x['answers_identical']}/{x['questions']}",
             ", ".join("–" if d is None else str(d) for d in x["first_divergence"])] for x in r["rows"]]  # fmt: skip
    head = ["runner", "precision", "teacher-forced top-1 agreement", "answers identical",
            "first divergence per question (–: none)"]  # fmt: skip
    note = (f"{r['model']}, {len(r['questions'])} questions in its chat template, {r['new_tokens']} new tokens; "
            f"reference: {r['reference']}; {r['cpu']}, {r['threads']} threads")  # fmt: skip
    if r.get("llama_cpp_skipped"):
        note += f"; llama.cpp rows skipped: {r['llama_cpp_skipped']}"
    return table(head, rows) + f"\n\nFrom `reports/bench_real_model_agreement.json` ({note}).", [
        "bench_real_model_agreement.json"
    ]


def precision_sweep_block(reports: Path) -> Block:
    """bench/precision_sweep.py: each method's dev-chosen point on test at each llama.cpp type, beside F32's."""
    r = load_report(reports, "bench_precision_sweep.json")
    types = list(r["types"])
    by = {t: {x["method"]: x for x in r["types"][t]["rows"]} for t in types}
    methods = list(by[types[0]])

    def cell(x: dict[str, Any] | None) -> str:
        if x is None:
            return "–"
        if x.get("no_point_meets_rule"):
            return "no dev point meets the rule"
        tau = "" if x.get("tau") is None else f", τ {x['tau']:.3f}"
        return f"{x['accuracy']:.3f}{ci(x.get('accuracy_ci'), lambda v: f'{v:.3f}')} ({x['bytes_moved_rel_llm']:.2f}× bytes{tau})"

    rows = [[m, *(cell(by[t].get(m)) for t in types)] for m in methods]
    head = ["method", *(f"{t}: test accuracy [95%] (bytes / LLM-only)" for t in types)]
    secs = ", ".join(f"{t} {r['types'][t]['seconds']:.0f} s" for t in types)
    note = f"the pipeline's pair ({r['pair']['slm']}, {r['pair']['llm']}), points chosen on dev; {r['cpu']}; {secs}"
    return table(head, rows) + f"\n\nFrom `reports/bench_precision_sweep.json` ({note}).", [
        "bench_precision_sweep.json"
    ]


LOAD_STAGES = ("bootstrap", "finetune", "iterate", "sweep")  # the costly ones, in pipeline order


QUIET_BOUND_S = 480.0  # the newcomer's bound: the default run within 8 minutes on 2 quiet cores


def load_block(reports: Path) -> Block:
    """bench/pipeline.py repro: the pipeline from a fresh clone, quiet and with one core kept busy."""
    r = load_report(reports, "bench_load.json")
    command = "citer pipeline" if r["command"] == "pipeline" else "dvc repro"
    rows = [[mode, f"{r[mode]['wall_s']:.0f} s ({r[mode]['wall_s'] / 60:.1f} min)",
             *(f"{r[mode]['stages_wall_s'].get(s, 0.0):.0f} s" for s in LOAD_STAGES)]
            for mode in ("quiet", "loaded") if mode in r]  # fmt: skip
    quiet = r["quiet"]["wall_s"]
    note = (f"`{command}` from a fresh clone of {r['commit'][:7]} on {r['cores']} cores, quiet "
            f"{'within' if quiet <= QUIET_BOUND_S else 'over'} {QUIET_BOUND_S / 60:.0f} minutes; loaded: another process "
            f"spinning on one core, {r['loaded_over_quiet']:.2f}× the quiet time (bound {r['bound']}: "
            f"{'holds' if r['holds'] else 'missed'}). A stage's time includes the stages inside it (in "
            f"`citer pipeline` the SLM's finetune runs inside bootstrap, beside the LLM's pretraining).")  # fmt: skip
    return table(["run", "wall", *LOAD_STAGES], rows) + f"\n\nFrom `reports/bench_load.json`: {note}", [
        "bench_load.json"
    ]
