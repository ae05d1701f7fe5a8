"""Stage ``synth``: write the embedded arithmetic task (both formats, three splits) from the synth params."""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import stage_run


@flow(name="synth")
def synth_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.data.synth import synthesize, write_splits

    proj = load_project(params_path)
    splits = synthesize(proj.params.synth)
    out_dir = proj.path(proj.params.paths.data_dir)
    write_splits(out_dir, splits)
    rows = {name: len(v) for name, v in splits.items()}
    with stage_run(proj, "synth") as run:
        run.params(proj.params.synth.model_dump(), prefix="synth.")
        run.metrics({f"rows.{k}": v for k, v in rows.items()})
    return {"dir": str(out_dir), "rows": rows}
