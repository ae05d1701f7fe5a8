"""Mutation testing of the modules that decide things. ``python scripts/mutation.py [--modules promotion session labels]``.

mutmut (the ``dev`` extra pins it) rewrites one module into many mutants (comparison flips, ``and``/``or`` swaps,
constants off by one, ``None`` for an argument or a result, strings changed...) and runs, against each, the tests
that reach the mutated function: a mutant is *killed* when a test fails, *survives* when all pass. Each module runs
with only the test files that exercise it (``MODULES``), in a fresh copy of the checkout in a temporary directory
(tracked and untracked-not-ignored files, so uncommitted tests count), so the working tree is never touched and
mutmut's ``mutants/`` directory lives and dies there. One test process at a time (``--max-children 1``).

Per module the report gives the mutants run, killed, survived, timeout, suspicious, skipped and untested (no test
reaches them), ``score`` = (killed + timeout) / (run - skipped) -- a timeout is a detected mutant, mutmut's own badge
counts it so -- and ``score_non_equivalent``, the same with the survivors judged equivalent (``scripts/
mutation_equivalent.py``: no test can tell them from the original) taken out of the denominator. Every survivor is
listed with its line and diff, and the reason where it was judged equivalent. A judgement applies only while the
mutant's name and mutated line both still match, so renumbered mutants after an edit show up unjudged.

More than ``--max-mutants`` mutants in a module (default 120): a seeded random sample of that many is run, recorded
as such. ``--rerun-survivors`` runs only the survivors recorded in ``--out`` for the same source (tests were added
since, none removed, so every mutant killed then is still killed) and carries the other results over; the entry keeps
the previous score. ``--mutants GLOB ...`` runs only the matching mutants (give it another ``--out``: its entry
replaces the module's). Writes ``reports/bench_mutation.json`` atomically; modules not run keep their entries there.
A dev tool, not a CI job: minutes per module on 2 cores (docs/mutation.md).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mutation_equivalent import EQUIVALENT  # noqa: E402  (this directory: sys.path[0])

from citer.ops.io import write_json  # noqa: E402
from citer.tracking.provenance import stamp_bench  # noqa: E402

# module -> (source, the test files that exercise it, tests left out and why they may be)
MODULES: dict[str, tuple[str, list[str], list[str]]] = {
    "promotion": (
        "citer/evaluation/promotion.py",
        ["tests/evaluation/test_promotion.py", "tests/tracking/test_alias.py"],
        [],
    ),
    "session": (
        "citer/decoding/session.py",
        [
            "tests/decoding/test_session.py",
            "tests/decoding/test_engine.py",
            "tests/decoding/test_static_step.py",
            "tests/decoding/test_scoring.py",  # the session's log-probs
        ],
        # Slow and about something else: that torch.compile traces the fixed-shape steps' pieces once per model. It
        # runs in CI.
        [
            "tests/decoding/test_static_step.py::test_steps_trace_whole_and_compile_once_per_model_whatever_the_bucket"
        ],
    ),
    "labels": (
        "citer/routing/labels.py",
        ["tests/routing/test_labels.py", "tests/routing/test_iterations.py"],
        [],
    ),
}

# mutmut's exit-code vocabulary (mutmut.stats.status_by_exit_code) folded into the report's columns
COLUMNS = {
    "killed": "killed",
    "caught by type check": "killed",
    "survived": "survived",
    "timeout": "timeout",
    "suspicious": "suspicious",
    "segfault": "suspicious",
    "skipped": "skipped",
    "no tests": "untested",
    "check was interrupted by user": "suspicious",
}


def copy_checkout(dest: Path) -> None:
    """The working tree's files as git sees them (uncommitted edits and new unignored files included)."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    for raw in names:
        rel = raw.decode()
        src = ROOT / rel
        if rel and src.is_file():  # deleted-but-tracked files are skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def configure(repo: Path, source: str, tests: list[str], deselect: list[str]) -> None:
    pyproject = repo / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    if "[tool.mutmut]" in text:
        raise SystemExit("pyproject.toml already has [tool.mutmut]; this tool writes its own per module")
    # mutmut runs the tests inside mutants/ (its copy of citer/ + tests/): everything else they read goes too.
    also = sorted(p.name for p in repo.iterdir() if p.name not in ("citer", "tests", "pyproject.toml"))
    pytest_args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "-q"]
    for d in deselect:
        pytest_args += ["--deselect", d]
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["citer"]\n'
        f"only_mutate = {toml_list([source])}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        f"pytest_add_cli_args = {toml_list(pytest_args)}\n"
        f"also_copy = {toml_list(also)}\n"
        "use_git_change_detection = false\n"
    )
    pyproject.write_text(text, encoding="utf-8")


def mutant_names(repo: Path, source: str) -> list[str]:
    """Every mutant mutmut will generate for ``source``, named as it names them."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    code = (repo / source).read_text(encoding="utf-8")
    reset_config()  # mutmut reads its config once, from the working directory: this module's copy
    with contextlib.chdir(repo):
        return [get_mutant_name(Path(source), n) for n in mutate_file_contents(source, code).mutant_names]


def def_lines(code: str) -> dict[tuple[str | None, str], int]:
    """``(class or None, function) -> line of its def`` for top-level functions and methods."""
    out: dict[tuple[str | None, str], int] = {}
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[(None, node.name)] = node.lineno
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[(node.name, sub.name)] = sub.lineno
    return out


def describe(repo: Path, source: str, name: str, defs: dict[tuple[str | None, str], int]) -> dict[str, Any]:
    """A mutant's line in the source file, its diff, and the lines it changes."""
    import libcst as cst
    from mutmut.mutation.diff_apply import get_diff_for_mutant, read_functions_from_index
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    with contextlib.chdir(repo):  # mutmut reads mutants/ relative to the working directory
        diff = get_diff_for_mutant(name, path=source)
        fns = read_functions_from_index(name, source)
    func, cls = orig_function_and_class_names_from_key(name)
    line = None
    if fns is not None and (cls, func) in defs:
        # The diff numbers lines from the function's first line (its decorators or a comment above it).
        code = cst.Module([fns[0]]).code.strip().split("\n")
        def_at = next(i for i, s in enumerate(code) if re.match(rf"\s*(async\s+)?def\s+{func}\b", s))
        m = re.search(r"^@@ -(\d+)", diff, re.M)
        if m:
            o = int(m.group(1))
            for d in diff.split("\n")[3:]:
                if d.startswith("-"):
                    break
                if not d.startswith("+"):
                    o += 1
            line = defs[(cls, func)] - def_at + o - 1
    minus = [d[1:].strip() for d in diff.split("\n")[2:] if d.startswith("-")]
    plus = [d[1:].strip() for d in diff.split("\n")[2:] if d.startswith("+")]
    return {
        "name": name,
        "line": line,
        "original": "\n".join(minus),
        "mutated": "\n".join(plus),
        "diff": diff,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def previous_survivors(key: str, prev: dict[str, Any] | None, source_sha: str, n_generated: int) -> list[str]:
    """The survivors of ``prev`` (this module's entry in an earlier report), if it ran this very source in full."""
    if prev is None or "survivors" not in prev:
        raise SystemExit(f"--rerun-survivors: the previous report has no result for {key}")
    if prev["source_sha256"] != source_sha or prev["generated"] != n_generated:
        raise SystemExit(
            f"--rerun-survivors: {prev['source']} changed since the previous report; run it in full"
        )
    if prev.get("selected_by"):
        raise SystemExit(f"--rerun-survivors: the previous {key} run was restricted to {prev['selected_by']}")
    return [s["name"] for s in prev["survivors"]]


def run_module(
    key: str, args: argparse.Namespace, mutmut: Path, prev: dict[str, Any] | None
) -> dict[str, Any]:
    source, tests, deselect = MODULES[key]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"citer-mutation-{key}-") as tmp:
        repo = Path(tmp)
        copy_checkout(repo)
        configure(repo, source, tests, deselect)
        source_sha = sha256(repo / source)
        names = mutant_names(repo, source)
        chosen = names
        if args.mutants:
            chosen = [n for n in names if any(fnmatch.fnmatch(n, g) for g in args.mutants)]
            if not chosen:
                return {"source": source, "skipped_module": f"no mutant matches {args.mutants}"}
        counts = dict.fromkeys(("killed", "survived", "timeout", "suspicious", "skipped", "untested"), 0)
        if args.rerun_survivors:
            # Tests were only added since: every mutant killed then is still killed, so only the survivors run again.
            run_names = previous_survivors(key, prev, source_sha, len(names))
            for s in prev["survivors"]:
                prev[COLUMNS[s["status"]]] -= 1
            counts = {c: prev[c] for c in counts}
            n, sample = prev["mutants"], prev["sample"]  # the population (and sample) of the previous run
        else:
            if len(chosen) > args.max_mutants:
                chosen = sorted(random.Random(args.seed).sample(chosen, args.max_mutants), key=names.index)
                sample = {"size": len(chosen), "of": len(names), "seed": args.seed}
            else:
                sample = None
            run_names, n = chosen, len(chosen)
        env = dict(
            os.environ,
            CITER_SHARED_DATA=os.environ.get("CITER_SHARED_DATA", str(ROOT.parent / "shared" / "data")),
        )
        log = repo / "mutmut.log"
        if run_names:
            with log.open("w") as fh:
                cmd = [str(mutmut), "run", "--max-children", "1", *(run_names if run_names != names else [])]
                proc = subprocess.run(
                    cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT
                )
            if proc.returncode != 0:
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"mutmut run failed for {key} (exit {proc.returncode}):\n{tail}")
        from mutmut.stats import status_by_exit_code

        meta = json.loads((repo / "mutants" / (source + ".meta")).read_text()) if run_names else {}
        defs = def_lines((repo / source).read_text(encoding="utf-8"))
        judged = EQUIVALENT.get(key, {})
        survivors, equivalent = [], []
        for name in run_names:
            status = status_by_exit_code[meta["exit_code_by_key"].get(name)]
            col = COLUMNS.get(status)
            if col is None:
                raise SystemExit(f"{name}: mutmut left it {status!r}")
            counts[col] += 1
            if col in ("survived", "untested", "suspicious"):
                d = describe(repo, source, name, defs) | {"status": status}
                j = judged.get(name)
                if j is not None and j[0] == d["mutated"]:
                    d["equivalent"] = j[1]
                    equivalent.append(name)
                survivors.append(d)
        test_sha = {t: sha256(repo / t) for t in tests}
    tested = n - counts["skipped"]
    detected = counts["killed"] + counts["timeout"]
    out = {
        "source": source,
        "source_sha256": source_sha,
        "tests": tests,
        "tests_sha256": test_sha,
        "deselected": deselect,
        "generated": len(names),
        "mutants": n,
        "sample": sample,
        "selected_by": args.mutants or None,
        **counts,
        "equivalent": len(equivalent),
        "score": round(detected / tested, 4) if tested else None,
        "score_non_equivalent": round(detected / (tested - len(equivalent)), 4)
        if tested > len(equivalent)
        else None,
        "survivors": survivors,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.rerun_survivors:
        out["rerun"] = {
            "ran": len(run_names),
            "killed_now": len(run_names) - len(survivors),
            "previous_score": prev["score"],
            # through any number of re-runs: the score of the first full run, before the tests were added
            "first_score": prev.get("rerun", {}).get("first_score", prev["score"]),
            "previous_tests_sha256": prev["tests_sha256"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", nargs="+", choices=sorted(MODULES), default=list(MODULES))
    ap.add_argument(
        "--max-mutants", type=int, default=120, help="more in a module: run a seeded sample of this many"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mutants", nargs="+", default=None, help="only mutants matching these globs (mutmut names)"
    )
    ap.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="run only the survivors recorded in --out (same source, tests only added since); carry the rest over",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench_mutation.json")
    args = ap.parse_args()
    # Modules not run this time keep their entries (each names its source, tests and their hashes).
    previous = json.loads(args.out.read_text())["modules"] if args.out.is_file() else {}
    mutmut = Path(sys.executable).parent / "mutmut"
    if not mutmut.is_file():
        raise SystemExit(f"{mutmut} not found: pip install -e '.[dev]' (mutmut is in the dev extra)")
    t0 = time.perf_counter()
    modules = dict(previous)
    for key in args.modules:
        print(f"mutation: {key} ...", flush=True)
        modules[key] = r = run_module(key, args, mutmut, previous.get(key))
        if "score" in r:
            print(
                f"  {r['mutants']} mutants: {r['killed']} killed, {r['timeout']} timeout, {r['survived']} survived "
                f"({r['equivalent']} judged equivalent), {r['untested']} untested, {r['suspicious']} suspicious; "
                f"score {r['score']}, without the equivalent {r['score_non_equivalent']} ({r['wall_seconds']} s)",
                flush=True,
            )
    wall = time.perf_counter() - t0
    report = {
        "tool": f"mutmut {importlib.metadata.version('mutmut')}",
        "score": "(killed + timeout) / (mutants - skipped); score_non_equivalent leaves the judged-equivalent out",
        "modules": modules,
        "wall_seconds": round(wall, 1),  # this run's modules only
        "note": "shared 2-core machine, one test process at a time",
    }
    write_json(args.out, report)
    stamp_bench(args.out, "mutation", args, wall)


if __name__ == "__main__":
    main()
