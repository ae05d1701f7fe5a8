"""Stage ``finetune_slm``: chain-of-thought SFT of the SLM (Trainer; DeepSpeed ZeRO-2 on GPUs when enabled)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import stage_run


@flow(name="finetune-slm")
def finetune_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.io import write_json
    from citer.models.finetune import finetune_slm

    proj = load_project(params_path)
    p = proj.params
    result = finetune_slm(
        proj.model_ref(p.models.slm),
        proj.read_split("train"),
        p.data.format,
        p.finetune,
        proj.path(p.models.finetuned_slm),
        eval_rows=proj.read_split("dev"),
        eval_batch_size=p.eval.batch_size,
        eval_max_new_tokens=p.eval.max_new_tokens,
    )
    summary = result.metrics() | {"deepspeed": result.deepspeed, "lora": result.lora}
    write_json(proj.reports / "finetune.json", summary)
    with stage_run(proj, "finetune_slm") as run:
        run.params(p.finetune.model_dump(), prefix="finetune.")
        run.params({"base": p.models.slm, "out": p.models.finetuned_slm})
        run.metrics(result.metrics())
        for h in result.log_history:
            step = int(h.get("step", 0))
            run.metrics({f"trainer.{k}": v for k, v in h.items() if k not in ("step", "epoch")}, step=step)
    return summary
