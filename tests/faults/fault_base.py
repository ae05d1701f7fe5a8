"""The base project every fault copies: the repository's tracked files without tests, shrunken params, one
``citer pipeline``, and the route inputs the faults use.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from fault_harness import BIG, N_BIG, SMALL, Proj
from fault_state import registry

REPO = Path(__file__).resolve().parents[2]

# The tests' tiny project (tests/conftest.py TINY), cut further: a command's cost is mostly its imports and stores,
# so the work is kept to the least that still exercises each stage: 16 new tokens, one τ, no ablation routers, no
# iteration-1/oracle/speculative/verified sweep methods, no router width grid, small route chunks (a killed route leaves a partial file).
PROJECT_PARAMS: dict[str, Any] = {
    "synth": {"n_train": 200, "n_dev": 12, "n_test": 12},
    "validate": {"files": [["data/embedded/math_test.jsonl", "math"]]},  # one split: each costs a GE context
    "bootstrap": {"slm_pretrain": {"steps": 20, "lr": 3e-3}, "llm_pretrain": {"steps": 30, "lr": 3e-3}},
    "finetune": {"max_steps": 5, "eval_examples": 4},
    "eval": {"n_examples": 4, "max_new_tokens": 16, "llm_chance_margin": None},  # the tiny pair is at chance
    "labels": {"n_examples": 12, "max_new_tokens": 16},
    "router": {"epochs": 3, "min_val_auc": 0.0, "ablations": [], "layers_grid": []},
    "registry": {"min_eval_examples": 1},
    "sweep": {
        "n_examples": 6,
        "llm_fractions": [0.3],
        "max_new_tokens": 16,
        "iter1": False,
        "oracle": False,
        "speculative": False,
        "verify": {"enabled": False},
        "query": {"train_examples": 8, "epochs": 5},
        "intervals": {"resamples": 100},
        "rule": {"kind": "max_accuracy_under_bytes", "bytes_budget_rel_llm": 0.99},
    },
    "inference": {"batch_size": 8, "max_new_tokens": 16},
    "runtime": {"workers": 1},
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def build_base(root: Path, api_url: str | None, timeout: float = 900) -> Path:
    """The tiny finished project: tracked files without tests, shrunken params, one ``citer pipeline``."""
    try:
        files = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(REPO)) for d in ("citer", "flows") for p in (REPO / d).rglob("*.py")]
        files += ["params.yaml", "dvc.yaml"]
    for f in files:
        if f.startswith("tests/") or not (REPO / f).is_file():
            continue
        dst = root / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst)
    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), PROJECT_PARAMS)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    logs = root.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    proj = Proj(root, api_url, logs)
    cmd = proj.run("pipeline", timeout=timeout)
    if cmd.rc != 0 or registry(root)["alias"] is None:
        raise RuntimeError(f"citer pipeline did not leave a champion (rc {cmd.rc}): {cmd.err[-2000:]}")
    test = [line for line in (root / params["data"]["test"]).read_text().splitlines() if line.strip()]
    (root / SMALL).write_text("\n".join(test[:2]) + "\n")
    (root / BIG).write_text("\n".join(test[i % len(test)] for i in range(N_BIG)) + "\n")
    return root
