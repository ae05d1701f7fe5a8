"""The numbers a person reads first, from the report files: the run's outcome as rows (the pair, the promoted point, the
claims) for the console's closing table and the HTML report, and the pipeline's own docs blocks (the headline, every
method's point, the claims across router seeds, the stages' times), which :mod:`citer.evaluation.docs_blocks` puts in
the docs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from citer.evaluation.tables import Block, ci, load_report, pct, table


def headline_rows(reports: str | os.PathLike[str], priced: bool = False) -> tuple[list[list[str]], list[str]]:
    """(label, value) rows of the run's outcome: the pair, the promoted point, the claims; and the files read.
    ``priced``: the same rows with every byte figure at the reference pair (``sweep_claims.json``'s ``priced``)."""
    d = Path(reports)
    models, promo, claims = (
        load_report(d, "models.json"),
        load_report(d, "promotion.json"),
        load_report(d, "sweep_claims.json"),
    )
    if priced:
        claims = _unlabelled(claims.get("priced") or {})
    sweep = {
        r["method"]: r
        for r in load_report(d, "sweep.json")
        if r.get("tau") is None or r.get("selected_on_dev")
    }
    rows = [
        [
            "LLM / finetuned SLM test accuracy (generation)",
            f"{pct(models['llm']['test_accuracy'])} / {pct(models['slm']['test_accuracy'])}",
        ],  # fmt: skip
    ]
    if promo.get("accuracy") is not None:
        method = promo.get("method") or "citer"
        c = sweep.get(method, {})
        how = f"{method}, τ {promo['tau']:.3f}"
        if promo.get("verify_rho") is not None:
            how += f", ρ {float(promo['verify_rho']):g}, W {promo['verify_window']}"
            how += ", final check" if str(promo.get("verify_final")).lower() == "true" else ""
        b, b_ci = promo["bytes_moved_rel_llm"], promo["bytes_ci"]
        if priced:
            b, b_ci = c.get("bytes_priced_rel_llm"), c.get("bytes_priced_ci")
        rows.append([
            f"promoted point ({how} chosen on dev; version {promo['version'] or '–'}, "
            f"promoted: {'yes' if promo['promoted'] else 'no'})",
            f"accuracy {pct(promo['accuracy'])}{ci(promo['accuracy_ci'], pct)}, bytes "
            + ("–" if b is None else f"{b:.3f}{ci(b_ci, lambda v: f'{v:.3f}')}") + " of LLM-only"
            + (f", {c['llm_token_fraction']:.3f} of tokens from the LLM" if c else ""),
        ])  # fmt: skip
    else:
        rows.append(["promoted point", f"none: {promo.get('reason', '')}"])
    rows += _router_rows(load_report(d, "sweep_claims.json").get("protocol", {}), promo, priced)
    for key, label in (("bytes_at_target", "CITER bytes at the rule's accuracy"),
                       ("oracle_ratio", "CITER / oracle bytes at 99% of LLM accuracy")):  # fmt: skip
        c = claims.get(key)
        if c:
            rows.append([label, c["statement"]])
    for base, c in sorted(claims.get("savings", {}).items()):
        rows.append([f"bytes saved vs {base}", c["statement"]])
    for m, vc in sorted(claims.get("verified", {}).items()):  # the verified decoder's own claims
        if vc.get("oracle_ratio"):
            rows.append([f"{m} / oracle bytes at 99% of LLM accuracy", vc["oracle_ratio"]["statement"]])
        for base in ("speculative", "bild", "citer"):
            if base in vc.get("savings", {}):
                rows.append([f"{m}: bytes saved vs {base}", vc["savings"][base]["statement"]])
    return rows, ["models.json", "promotion.json", "sweep_claims.json", "sweep.json"]


def _unlabelled(found: Any) -> Any:
    """Priced claims without their ``Priced at <pair>:`` prefix (the column says where they are priced)."""
    if isinstance(found, dict):
        return {k: (v.split(": ", 1)[1] if k == "statement" and v.startswith("Priced at ") else _unlabelled(v))
                for k, v in found.items()}  # fmt: skip
    if isinstance(found, list):
        return [_unlabelled(v) for v in found]
    return found


def _router_rows(protocol: dict[str, Any], promo: dict[str, Any], priced: bool) -> list[list[str]]:
    """The CITER router's width (chosen on dev when there is a grid) and its reads per step as a share of the SLM's
    weight read, and the promoted router's."""
    reads = protocol.get("router_reads") or {}
    layers = protocol.get("router_layers") or {}
    key = "priced" if priced else "measured"

    def share(info: dict[str, Any] | None) -> str:
        got = (info or {}).get(key)
        return "–" if not got else f"{100 * got['share_of_slm']:.2f}% of the SLM's weight bytes per step"

    rows = []
    if layers:
        chosen = layers["chosen"]
        rows.append([f"CITER router width (chosen on dev among {', '.join(layers['grid'])}): {chosen}",
                     share(layers["grid"].get(chosen))])  # fmt: skip
    elif "citer" in reads:
        rows.append([f"CITER router width {_widths(reads['citer'])}", share(reads["citer"])])
    router = promo.get("method")
    if router == "citer_verify":  # the router variant the verified decoder runs on
        router = (protocol.get("verify") or {}).get("citer_verify_router")
    if router == "citer" and layers:
        router = layers["chosen"]
    info = (layers.get("grid") or {}).get(router) or reads.get(router or "")
    if router and info:
        rows.append([f"promoted router's reads ({router}, {_widths(info)})", share(info)])
    return rows


def _widths(info: dict[str, Any]) -> str:
    w = info.get("widths") or []
    return "linear probe" if not w else "hidden layers " + " x ".join(f"{x:g}h" for x in w)


def headline_block(reports: Path) -> Block:
    rows, files = headline_rows(reports)
    d = Path(reports)
    name = (load_report(d, "sweep_claims.json").get("priced") or {}).get("priced_at")
    if name is None:
        return table(
            ["", "measured on test (chosen on dev)"], rows
        ) + f"\n\nFrom {', '.join(f'`reports/{f}`' for f in files)}.", files
    at, _ = headline_rows(reports, priced=True)
    both = [[label, value, other if label == other_label else "–"]
            for (label, value), (other_label, other) in zip(rows, at, strict=True)]  # fmt: skip
    src = ", ".join(f"`reports/{f}`" for f in files)
    head = ["", "measured on test (chosen on dev)", f"priced at {name}: the same calls (chosen on dev)"]
    return table(head, both) + f"\n\nFrom {src}.", files


def sweep_block(reports: Path) -> Block:
    """Every method at its dev-chosen point (fixed rows: their one point), on test with 95% intervals."""
    rows = []
    sweep = load_report(reports, "sweep.json")
    name = next((r["priced_at"] for r in sweep if r.get("priced_at")), None)
    for r in sweep:
        if r.get("tau") is not None and not r.get("selected_on_dev"):
            continue
        tau = "–" if r.get("tau") is None else f"{r['tau']:.3f}"
        rows.append([
            r["method"], tau, f"{r['accuracy']:.3f}{ci(r.get('accuracy_ci'), lambda v: f'{v:.3f}')}",
            "–" if r.get("llm_token_fraction") is None else f"{r['llm_token_fraction']:.3f}",
            f"{r['bytes_moved_rel_llm']:.3f}{ci(r.get('bytes_ci'), lambda v: f'{v:.3f}')}",
        ])  # fmt: skip
        if name is not None:
            b = r.get("bytes_priced_rel_llm")
            rows[-1].append(
                "–" if b is None else f"{b:.3f}{ci(r.get('bytes_priced_ci'), lambda v: f'{v:.3f}')}"
            )
    head = ["method", "τ (dev)", "test accuracy [95%]", "LLM tokens", "bytes / LLM-only [95%]"]
    if name is not None:
        head.append(f"bytes / LLM-only priced at {name} [95%]")
    return table(head, rows) + "\n\nFrom `reports/sweep.json`.", ["sweep.json"]


def _claim_value(key: str, v: float | None) -> str:
    if v is None:
        return "not reached"
    if "saving" in key:
        return f"{100 * v:.0f}%"
    return f"{v:.2f}x" if "oracle" in key else f"{v:.3f}"


def stability_block(reports: Path) -> Block:
    """``citer eval stability``: each headline claim's value and interval in the main run, its range over the router
    seeds and in how many seeds it holds at 95%, under both pricings; the promoted point in every seed."""
    st = load_report(reports, "stability.json")
    seeds = st["seeds"]
    name = next((c["main"]["statement"].split(": ", 1)[0].removeprefix("Priced at ")
                 for c in st["claims"]["priced"].values() if c["main"].get("statement")), None)  # fmt: skip
    rows = []
    for key in st["claims"]["measured"]:
        if "not worse than" in key:  # the dominance checks stay in reports/stability.json
            continue
        row = [key]
        for pricing in ("measured", "priced"):
            got = st["claims"][pricing].get(key)
            if got is None:
                row += ["–", "–", "–"]
                continue

            def fmt(v: float | None, k: str = key) -> str:
                return _claim_value(k, v)

            main = got["main"]
            held = sum(got["by_seed"][str(x)]["holds_at_95"] is True for x in seeds)
            values = [fmt(got["by_seed"][str(x)]["value"]) for x in seeds]
            row += [fmt(main["value"]) + ci(main.get("ci"), fmt), ", ".join(values), f"{held}/{len(seeds)}"]
        rows.append(row)
    pts = st["promoted"]["by_seed"]
    shown = []
    for x in seeds:
        p = pts[str(x)]
        shown.append(
            "none" if not p else f"{p['method']} {pct(p['accuracy'])} ({p['accuracy_ratio']:.3f} of LLM)"
        )
    rows.append(["promoted point on test (method, accuracy, share of LLM accuracy)", "", "; ".join(shown), "",
                 "", "", ""])  # fmt: skip
    width = "; ".join(f"seed {x}: {st['router_width'][str(x)] or '–'}" for x in seeds)
    head = ["claim (test, chosen on dev)", f"main run (seed {st['main_seed']}) [95%]",
            f"seeds {', '.join(map(str, seeds))}", "holds at 95%", f"priced at {name}: main run [95%]",
            "priced: seeds", "priced: holds at 95%"]  # fmt: skip
    note = f"CITER router width chosen on dev: {width}. From `reports/stability.json`."
    return table(head, rows) + f"\n\n{note}", ["stability.json"]


# The pipeline's own stages, in the order it runs them (label collection and router training run inside iterate).
PIPELINE_STAGES = ("synth", "validate", "bootstrap", "finetune", "eval_models", "iterate", "sweep", "route")


def pipeline_block(reports: Path) -> Block:
    """The pipeline's wall time, each stage's, and the reports each wrote, from reports/provenance.json."""
    prov = load_report(reports, "provenance.json")
    runs = prov.get("runs", {})
    written: dict[str, list[str]] = {}
    for path, e in prov["files"].items():
        written.setdefault(e["stage"], []).append(Path(path).name)
    written["iterate"] = written.get("router", []) + written.get("labels", [])
    # provenance.json keeps every stage's latest run (what dvc.lock records), and a `citer pipeline`'s whole time: that
    # one counts only if the same code wrote the sweep (`dvc repro` of newer code leaves an older pipeline's behind)
    commit = runs.get("sweep", {}).get("commit")
    runs = {k: v for k, v in runs.items() if k != "pipeline" or commit is None or v.get("commit") == commit}
    rows = [[name, f"{runs[name]['wall_s']:.0f} s", ", ".join(sorted(written.get(name, []))) or "–"]
            for name in PIPELINE_STAGES if name in runs]  # fmt: skip
    if "pipeline" in runs:
        rows.append(["**whole pipeline**", f"**{runs['pipeline']['wall_s']:.0f} s**", ""])
    first = runs.get("pipeline") or runs.get("sweep") or next(iter(runs.values()), None)
    m = first["machine"] if first else {}
    where = (f"commit `{first['commit'][:12]}`, {m['cores']} cores, {m.get('cpu', 'CPU not recorded')}, torch "
             f"{m['torch']}, {m['device']}" if first else "")  # fmt: skip
    return table(
        ["stage", "wall", "reports written"], rows
    ) + f"\n\nFrom `reports/provenance.json` ({where}).", ["provenance.json"]
