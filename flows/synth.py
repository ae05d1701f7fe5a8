"""Stage ``synth``: write the embedded arithmetic task (both formats, three splits) from the synth params.

Disabled (your own data), it only checks that ``data.train/dev/test`` exist and never touches them.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from citer.project import load_project
from flows.common import locked, stage_run


@flow(name="synth")
@locked("synth")
def synth_flow(params_path: str = "params.yaml") -> dict[str, Any]:
    from citer.data.synth import split_paths, synthesize, write_splits
    from citer.ops.io import file_digest, write_json

    proj = load_project(params_path)
    p = proj.params
    splits = {key: getattr(p.data, key) for key in ("train", "dev", "test")}
    report = proj.reports / "synth.json"
    if not p.synth.enabled:
        for key, path in splits.items():
            if not proj.path(path).is_file():
                raise FileNotFoundError(
                    f"synth.enabled is false but data.{key}={path} does not exist ({proj.path(path)})"
                )
        # The record bootstrap depends on: it stays the same when your own files change.
        write_json(report, {"enabled": False})
        listed = ", ".join(f"data.{k}={v}" for k, v in splits.items())
        return {
            "disabled": f"synth disabled (synth.enabled: false): using your data, left untouched: {listed}"
        }
    out_dir = proj.path(p.paths.data_dir)
    written = split_paths(out_dir)
    for key, path in splits.items():
        if proj.path(path).resolve() not in {f.resolve() for f in written}:
            raise ValueError(
                f"synth.enabled is true but data.{key}={path} is not a file synth writes "
                f"({out_dir}/{{math,mc}}_{{train,dev,test}}.jsonl); set synth.enabled: false to use your own data"
            )
    data = synthesize(p.synth)
    rows = {name: len(v) for name, v in data.items()}
    write_splits(out_dir, data)
    write_json(report, {"enabled": True, "rows": rows, "sha256": {f.name: file_digest(f) for f in written}})
    with stage_run(proj, "synth") as run:
        run.params(p.synth.model_dump(), prefix="synth.")
        run.metrics({f"rows.{k}": v for k, v in rows.items()})
    return {"dir": str(out_dir), "rows": rows}
