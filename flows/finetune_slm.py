"""Stage ``finetune_slm``: chain-of-thought SFT of the SLM (Trainer; DeepSpeed ZeRO-2 on GPUs when enabled)."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from citer.project import load_project
from flows.common import locked, stage_run


@task(name="finetune-disabled")
def finetune_disabled(proj) -> dict[str, Any]:
    """finetune.enabled false: routing uses models.slm as is; nothing is trained and nothing is removed."""
    from citer.ops.io import write_json

    m = proj.params.models
    if not proj.path(m.slm).is_dir():
        raise FileNotFoundError(
            f"finetune.enabled is false but models.slm={m.slm} is not a directory ({proj.path(m.slm)})"
        )
    # DVC records models.finetuned_slm as this stage's output: an empty placeholder when nothing is there.
    proj.path(m.finetuned_slm).mkdir(parents=True, exist_ok=True)
    write_json(proj.reports / "finetune.json", {"enabled": False, "slm": m.slm})
    return {
        "disabled": f"finetune disabled (finetune.enabled: false): routing uses models.slm={m.slm} (present); "
        f"models.finetuned_slm={m.finetuned_slm} is not used"
    }


@flow(name="finetune-slm")
@locked("finetune")
def finetune_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.models.finetune import finetune_slm
    from citer.tracking.provenance import write_results

    proj = load_project(params_path)
    p = proj.params
    if not p.finetune.enabled:
        return finetune_disabled(proj)
    train = proj.read_split("train")
    result = finetune_slm(
        proj.model_ref(p.models.slm),
        train,
        p.data.format,
        p.finetune,
        proj.path(p.models.finetuned_slm),
        eval_rows=proj.read_split("dev"),
        eval_batch_size=p.eval.batch_size,
        eval_max_new_tokens=p.eval.max_new_tokens,
    )
    summary = result.metrics() | {"deepspeed": result.deepspeed, "lora": result.lora}
    # Under finetune.max_truncated_fraction (above it finetune_slm refuses), but a cut row still teaches no answer.
    log = get_run_logger().warning if result.truncated_examples else get_run_logger().info
    log(
        f"finetune: {result.truncated_examples} of {len(train)} training rows "
        f"({result.truncated_fraction:.1%}) cut at finetune.max_length={p.finetune.max_length}"
    )
    write_results(proj.reports / "finetune.json", summary, stage="finetune")
    with stage_run(proj, "finetune_slm") as run:
        run.params(p.finetune.model_dump(), prefix="finetune.")
        run.params({"base": p.models.slm, "out": p.models.finetuned_slm})
        run.metrics(result.metrics())
        for h in result.log_history:
            step = int(h.get("step", 0))
            run.metrics({f"trainer.{k}": v for k, v in h.items() if k not in ("step", "epoch")}, step=step)
    return summary
