"""Stage ``batch_inference``: the champion router over a JSONL of questions; a rerun resumes where it stopped."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import load_context, stage_run, tracking_uri


@flow(name="batch-inference")
def batch_inference_flow(
    params_path: str = "params.yaml", input: str | None = None, output: str | None = None
) -> dict[str, Any]:
    from citer.champion import build_engine_from_champion
    from citer.inference import route_file
    from citer.models import load_tokenizer
    from citer.registry import require_champion

    ctx = load_context(params_path)
    p = ctx.params
    inf = p.inference
    reg = p.registry
    rv = require_champion(reg.model_name, reg.alias, tracking_uri(ctx))
    tau = inf.tau if inf.tau is not None else rv.tau
    fmt = inf.format or p.data.format
    src = ctx.path(input or inf.input)
    dst = ctx.path(output or inf.output)

    def engine():
        return build_engine_from_champion(p, root=ctx.root, tracking_uri=tracking_uri(ctx), tau=tau)[0]

    summary = route_file(
        engine,
        load_tokenizer(ctx.model_ref(rv.tags["slm"])),
        src,
        dst,
        fmt,
        batch_size=inf.batch_size,
        max_new_tokens=inf.max_new_tokens,
        meta={"router_version": rv.version, "tau": tau},
    )
    with stage_run(ctx, "batch_inference") as run:
        run.params({"input": str(src), "output": str(dst), "router_version": rv.version, "tau": tau})
        run.metrics({k: v for k, v in summary.to_dict().items() if v is not None})
    return summary.to_dict() | {"output": str(dst), "router_version": rv.version, "tau": tau}
