"""Stage ``finetune_slm``: chain-of-thought SFT of the SLM (Trainer; DeepSpeed ZeRO-2 on GPUs when enabled)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import load_context, stage_run


@flow(name="finetune-slm")
def finetune_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.finetune import finetune_slm
    from citer.io import write_json

    ctx = load_context(params_path)
    p = ctx.params
    result = finetune_slm(
        ctx.model_ref(p.models.slm),
        ctx.read_split("train"),
        p.data.format,
        p.finetune,
        ctx.path(p.models.finetuned_slm),
        eval_rows=ctx.read_split("dev"),
        eval_batch_size=p.eval.batch_size,
        eval_max_new_tokens=p.eval.max_new_tokens,
    )
    summary = result.metrics() | {"deepspeed": result.deepspeed, "lora": result.lora}
    write_json(ctx.reports / "finetune.json", summary)
    with stage_run(ctx, "finetune_slm") as run:
        run.params(p.finetune.model_dump(), prefix="finetune.")
        run.params({"base": p.models.slm, "out": p.models.finetuned_slm})
        run.metrics(result.metrics())
        for h in result.log_history:
            step = int(h.get("step", 0))
            run.metrics({f"trainer.{k}": v for k, v in h.items() if k not in ("step", "epoch")}, step=step)
    return summary
