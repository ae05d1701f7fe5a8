"""The docs blocks: the measured tables README.md, docs/results.md and docs/gpu.md quote, rendered from the report
files.

README.md and docs/results.md hold their measured tables between markers::

    <!-- citer:NAME -->
    ...generated markdown...
    <!-- /citer:NAME -->

:func:`render_blocks` builds every block from ``reports/`` alone, each table naming the files it read;
``citer report docs`` rewrites the blocks in place and ``tests/test_docs_numbers.py`` fails when a committed block
differs from what the committed reports render, or when a file it reads has no matching entry in
``reports/provenance.json`` -- so the docs cannot drift from the data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from citer.evaluation.bench_tables import (
    cpu_linear_block,
    labels_block,
    llama_cpp_routed_block,
    load_block,
    precision_sweep_block,
    real_model_agreement_block,
    roofline_block,
    serving_block,
    speed_block,
)
from citer.evaluation.headline import headline_block, pipeline_block, stability_block, sweep_block
from citer.evaluation.tables import Block
from citer.ops.io import write_text

BLOCKS: dict[str, Callable[[Path], Block]] = {
    "load": load_block,
    "labels": labels_block,
    "serving": serving_block,
    "headline": headline_block,
    "sweep": sweep_block,
    "pipeline": pipeline_block,
    "engine": lambda reports: speed_block(reports, "bench_engine.json"),
    "stability": stability_block,
    "speed_cpu": speed_block,
    "speed_cpu_float": lambda reports: speed_block(reports, "bench_cpu_fp32.json"),
    "speed_cpu_llama_cpp": lambda reports: speed_block(reports, "bench_cpu_llama_cpp.json"),
    "speed_gpu": lambda reports: speed_block(reports, "bench_gpu.json"),
    "roofline": roofline_block,
    "llama_cpp_routed": llama_cpp_routed_block,
    "real_model_agreement": real_model_agreement_block,
    "precision_sweep": precision_sweep_block,
}


_MARK = re.compile(r"<!-- citer:(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /citer:(?P=name) -->", re.S)


def blocks_in(text: str) -> dict[str, str]:
    """The generated blocks a document holds: ``{name: body}``."""
    return {m["name"]: m["body"].removesuffix("\n") for m in _MARK.finditer(text)}


# One block per CPU kind a bench ran on: ``llama_cpp_routed_<kind>`` renders bench_cpu_llama_cpp_routed_<kind>.json,
# ``cpu_linear_<kind>`` bench_cpu_linear_<kind>.json.
_PER_CPU = {
    "llama_cpp_routed_": (llama_cpp_routed_block, "bench_cpu_llama_cpp_routed_"),
    "cpu_linear_": (cpu_linear_block, "bench_cpu_linear_"),
    "roofline_": (roofline_block, "bench_roofline_"),
}


def block(name: str) -> Callable[[Path], Block] | None:
    """The renderer of block ``name``: a fixed one, or a per-CPU report's; None where none is known."""
    if name in BLOCKS:
        return BLOCKS[name]
    for prefix, (render, file) in _PER_CPU.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return lambda reports: render(reports, f"{file}{name.removeprefix(prefix)}.json")
    return None


def render_blocks(reports: str | os.PathLike[str], names: list[str]) -> dict[str, Block]:
    unknown = [n for n in names if block(n) is None]
    if unknown:
        raise ValueError(
            f"unknown citer blocks {unknown}; known: {sorted(BLOCKS)} and {[p + '<cpu>' for p in _PER_CPU]}"
        )
    return {n: block(n)(Path(reports)) for n in names}


def rewrite(doc: str | os.PathLike[str], reports: str | os.PathLike[str]) -> list[str]:
    """Re-render every block ``doc`` holds from ``reports`` (atomically); returns the block names."""
    path = Path(doc)
    text = path.read_text(encoding="utf-8")
    names = list(blocks_in(text))
    try:
        fresh = render_blocks(reports, names)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    new = _MARK.sub(
        lambda m: f"<!-- citer:{m['name']} -->\n{fresh[m['name']][0]}\n<!-- /citer:{m['name']} -->", text
    )
    if new != text:
        write_text(path, new)
    return names
