"""Stage ``eval_models``: greedy test accuracy of the SLM and the LLM alone -> reports/models.json.

Both models are loaded as every other stage loads them (:meth:`citer.project.Project.load_pair`): ``models.dtype``,
the SLM on ``models.device``, the LLM on ``models.llm_device_map`` when set (else ``models.device`` too) and
``models.trust_remote_code``; one model at a time, so the pair never has to fit in memory together.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from citer.project import load_project
from flows.common import locked, stage_run


@task(name="evaluate-model", task_run_name="evaluate {name}")
def evaluate_one(
    name: str,
    ref: str,
    rows: list[dict[str, Any]],
    fmt: str,
    batch_size: int,
    max_new_tokens: int,
    dtype: str = "float32",
    device: str | dict[str, Any] = "cpu",
    trust_remote_code: bool = False,
):
    """``(parameter count, ModelEval)`` of the model at ``ref`` loaded in ``dtype`` on ``device`` (a torch device
    string or a device_map)."""
    from citer.models.evaluate import evaluate_model
    from citer.models.loading import count_params, load_model

    model, tok = load_model(ref, dtype, device, trust_remote_code)
    return count_params(model), evaluate_model(model, tok, rows, fmt, batch_size, max_new_tokens)


@flow(name="eval-models")
@locked("eval_models")
def eval_models_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.models.chance import chance_accuracy, check_llm_above_chance
    from citer.models.evaluate import write_models_report
    from citer.tracking.provenance import read as read_provenance

    proj = load_project(params_path)
    p = proj.params
    rows = proj.read_split("test")
    if p.eval.n_examples:
        rows = rows[: p.eval.n_examples]
    fmt, m = p.data.format, p.models
    # Placed as Project.load_pair places the pair: the LLM follows llm_device_map when one is given.
    llm_place = m.device if m.llm_device_map is None else m.llm_device_map
    load = {"dtype": m.dtype, "trust_remote_code": m.trust_remote_code}
    inputs = {
        "rows": rows,
        "fmt": fmt,
        "batch_size": p.eval.batch_size,
        "max_new_tokens": p.eval.max_new_tokens,
    }
    slm_n, slm_ev = evaluate_one("slm", proj.slm_ref, **inputs, device=m.device, **load)
    llm_n, llm_ev = evaluate_one("llm", proj.llm_ref, **inputs, device=llm_place, **load)
    facts = read_provenance(proj.reports).get("run_facts", {})
    # time to build the pair: bootstrap + finetune, when this project ran them
    seconds = sum(float(facts.get(stage, {}).get("seconds", 0.0)) for stage in ("bootstrap", "finetune"))
    report = write_models_report(
        proj.reports / "models.json", slm_n, slm_ev.accuracy, llm_n, llm_ev.accuracy, seconds
    )
    chance = chance_accuracy(rows, fmt)
    with stage_run(proj, "eval_models") as run:
        run.params(
            {
                "slm": proj.slm_name,
                "llm": p.models.llm,
                "n_examples": len(rows),
                "dtype": m.dtype,
                "device": m.device,
                "llm_device_map": str(m.llm_device_map),  # one param, however many entries
            }
        )
        run.metrics({f"slm.{k}": v for k, v in slm_ev.metrics().items()})
        run.metrics({f"llm.{k}": v for k, v in llm_ev.metrics().items()})
        run.metrics({"slm.params": slm_n, "llm.params": llm_n, "param_ratio": llm_n / max(slm_n, 1)})
        run.metrics({"llm.chance_accuracy": chance})
    # After the report and the run: they show what the LLM did. An LLM at chance stops the pipeline here.
    check_llm_above_chance(llm_ev.accuracy, chance, p.eval.llm_chance_margin, len(rows), p.models.llm)
    return report


@flow(name="eval-model")
def eval_one_flow(
    model: str, data: str, fmt: str, batch_size: int = 64, max_new_tokens: int = 96, limit: int = 0
) -> dict[str, Any]:
    """``citer eval model``: one model alone on one file (no params file needed)."""
    from citer.data.jsonl import read_jsonl

    rows = read_jsonl(data, fmt)
    rows = rows[:limit] if limit else rows
    n_params, ev = evaluate_one("model", model, rows, fmt, batch_size, max_new_tokens)
    return {"model": model, "data": data, "params": n_params, **ev.metrics()}
