#!/usr/bin/env python3
"""Check the package layout: no import cycles, imports only downward, no tools in the math; long modules named.

    python scripts/check_layout.py          # prints the layers and exits 1 if any rule is broken
    python scripts/check_layout.py --deps   # rewrites dvc.yaml's code deps to what each stage runs (rule 6)

Rules (every ``import`` counts, module level or inside a function, since a lazy import is still a dependency):
1. No import cycle among ``citer`` and ``flows`` modules.
2. A module imports only from its own layer or below (:data:`LAYERS`, bottom first).
3. Prefect is imported only by ``flows`` and the command's temporary server (``citer.cli.prefect_server``); MLflow only
   by ``citer.tracking``, the router's pyfunc wrapper and ``flows``.
4. Every top-level function of a stage flow module is a Prefect ``@flow`` or ``@task`` (flows compose, the
   library decides); shared helpers live in ``flows/common.py``.
5. One name per thing: no two ``citer`` modules share a file name, outside ``citer.config`` (which mirrors the
   params blocks, as ``flows`` mirrors the stages).
6. Every ``dvc.yaml`` stage's ``deps`` cover the code its command runs: each module its ``citer`` command imports,
   and every project module those import in turn, is a listed file or lies under a listed folder. So a change to any
   code a stage runs makes ``dvc status`` name that stage (CI's ``scripts/check_records.py`` then asks for its rerun).
Modules are split by concept, not by size: one longer than :data:`REVIEW_LINES` lines is named as a warning (a
review asks whether it holds more than one concept), never a failure.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Bottom first. A module belongs to the most specific entry that is its name or a package above it, so a room's
# modules may sit in different layers (``citer.ops.threads`` reads the project, the rest of ``citer.ops`` nothing).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("citer.config", "citer.ops", "citer.tracking.provenance"),
    # reading a .gguf's config is a file format, as JSONL is; the CPU kernels know nothing of models or decoding
    ("citer.data", "citer.models.gguf", "citer.kernels"),
    ("citer.models", "citer.decoding"),
    ("citer.routing", "citer.evaluation"),
    (
        "citer.project",
        "citer.ops.preflight",
        "citer.ops.threads",
        "citer.tracking",
        "citer.routing.workers",
        "citer.serving",
    ),
    ("flows",),
    ("citer.cli",),
)
REVIEW_LINES = 500
TOOL_IMPORTS = {
    "prefect": (
        "flows",
        "citer.cli.prefect_server",
    ),  # the command's own temporary server: the shell, not the math
    "mlflow": ("citer.tracking", "citer.routing.pyfunc", "flows"),
}
FLOW_HELPERS = ("flows.common",)  # flows modules allowed to hold plain functions
API_FACE = "citer"  # citer/__init__.py names the public API lazily and sits above every layer


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_modules(root: Path, packages: Iterable[str] = ("citer", "flows")) -> dict[str, Module]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            name = _module_name(root, path)
            out[name] = Module(name, path, ast.parse(text, str(path)), text.count("\n"))
    return out


def _imported(node: ast.AST, mod: Module) -> list[str]:
    """Module names an import statement names (``from a import b`` names ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the importing package
            base = mod.name.split(".")
            if mod.path.name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        return [target] + [f"{target}.{a.name}" for a in node.names]
    return []


def import_graph(mods: dict[str, Module]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(edges, tools)``: project modules each module imports, and the top-level third-party names it imports."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    tools: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods.values():
        for node in ast.walk(m.tree):
            for name in _imported(node, m):
                if name in mods and name != m.name:
                    edges[m.name].add(name)
                elif name and name.split(".")[0] not in ("citer", "flows"):
                    tools[m.name].add(name.split(".")[0])
    return edges, tools


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int | None:
    found = [(len(p), i) for i, group in enumerate(LAYERS) for p in group if _under(name, p)]
    return max(found)[1] if found else None


def long_modules(root: Path) -> list[str]:
    """Modules longer than :data:`REVIEW_LINES` lines, one line each: a reason to review, not a failure."""
    return [
        f"{m.path.relative_to(root)}: {m.lines} lines (more than {REVIEW_LINES}); does it hold one concept?"
        for m in load_modules(root).values()
        if m.lines > REVIEW_LINES
    ]


def check(root: Path) -> list[str]:
    """Every broken rule, one line each (empty when the layout holds)."""
    mods = load_modules(root)
    edges, tools = import_graph(mods)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    for name, m in sorted(mods.items()):
        rel = m.path.relative_to(root)
        here = layer_of(name)
        if name != API_FACE:
            if here is None:
                problems.append(f"{rel}: module {name} is in no layer of scripts/check_layout.py LAYERS")
            else:
                for dep in sorted(edges[name]):
                    there = layer_of(dep)
                    if there is not None and there > here:
                        problems.append(
                            f"{rel}: {name} (layer {here}) imports {dep} (layer {there}), a layer above it"
                        )
        for tool, allowed in TOOL_IMPORTS.items():
            if tool in tools[name] and not any(_under(name, a) for a in allowed):
                problems.append(f"{rel}: imports {tool}; only {', '.join(allowed)} may")
        if _under(name, "flows") and name not in FLOW_HELPERS:
            problems += _plain_flow_functions(m, rel)
    named: dict[str, list[str]] = {}
    for m in mods.values():
        if _under(m.name, "citer") and not _under(m.name, "citer.config") and m.path.stem[:2] != "__":
            named.setdefault(m.path.name, []).append(str(m.path.relative_to(root)))
    problems += [
        f"{n}: one name for {len(ps)} modules ({', '.join(ps)})" for n, ps in named.items() if len(ps) > 1
    ]
    return problems + uncovered_stage_code(root, mods, edges)


def command_imports(mods: dict[str, Module]) -> dict[str, set[str]]:
    """``{"citer eval sweep": {project modules the command's function imports}}`` from ``citer.cli``'s Typer
    commands (``@eval_app.command("sweep")`` is ``citer eval sweep``; ``@app.command`` a top-level command)."""
    cli = mods.get("citer.cli")
    out: dict[str, set[str]] = {}
    if cli is None:
        return out
    for node in cli.tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for d in node.decorator_list:
            if not (
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
            ):
                continue
            app = d.func.value.id if isinstance(d.func.value, ast.Name) else ""
            name = d.args[0].value if d.args and isinstance(d.args[0], ast.Constant) else node.name
            group = "" if app == "app" else app.removesuffix("_app") + " "
            found = {n for sub in ast.walk(node) for n in _imported(sub, cli) if n in mods}
            out[f"citer {group}{name}"] = found
    return out


def stage_code(root: Path, mods: dict[str, Module], edges: dict[str, set[str]]) -> dict[str, dict[str, str]]:
    """Per ``dvc.yaml`` stage whose command is a ``citer`` command: ``{module file: the module that imports it}``,
    every project module the command runs (imports are followed transitively, lazy ones included)."""
    import yaml

    spec = root / "dvc.yaml"
    if not spec.is_file():
        return {}
    out = {}
    commands = command_imports(mods)
    for stage, body in (yaml.safe_load(spec.read_text(encoding="utf-8")).get("stages") or {}).items():
        cmd = " ".join(str(body.get("cmd", "")).split()[:4])
        start = next((v for k, v in commands.items() if cmd == k or cmd.startswith(k + " ")), None)
        if start is None:
            continue
        seen: dict[str, str] = {m: "the command" for m in start}
        todo = list(start)
        while todo:
            m = todo.pop()
            for dep in edges[m]:
                if dep not in seen:
                    seen[dep] = m
                    todo.append(dep)
        out[stage] = {mods[m].path.relative_to(root).as_posix(): by for m, by in seen.items()}
    return out


def uncovered_stage_code(root: Path, mods: dict[str, Module], edges: dict[str, set[str]]) -> list[str]:
    """Rule 6: a module a stage runs that none of its ``deps`` covers, one line each."""
    import yaml

    spec = root / "dvc.yaml"
    if not spec.is_file():
        return []
    stages = yaml.safe_load(spec.read_text(encoding="utf-8")).get("stages") or {}
    problems = []
    for stage, files in sorted(stage_code(root, mods, edges).items()):
        deps = [str(d).rstrip("/") for d in stages[stage].get("deps", []) if "${" not in str(d)]
        for f, by in sorted(files.items()):
            if not any(f == d or f.startswith(d + "/") for d in deps):
                problems.append(
                    f"dvc.yaml: stage {stage} runs {f} (imported by {by}) but no dep covers it: add it or its folder"
                )
    return problems


def _plain_flow_functions(m: Module, rel: Path) -> list[str]:
    out = []
    for node in m.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = {
                (d.func if isinstance(d, ast.Call) else d).id
                for d in node.decorator_list
                if isinstance(d.func if isinstance(d, ast.Call) else d, ast.Name)
            }
            if not names & {"flow", "task"}:
                out.append(
                    f"{rel}: function {node.name} is neither a @flow nor a @task (library logic belongs in citer/)"
                )
    return out


def describe(root: Path) -> str:
    """The layers, top first, with each module's line count and the layers it imports from."""
    mods = load_modules(root)
    edges, _ = import_graph(mods)
    lines = []
    for i in reversed(range(len(LAYERS))):
        names = [n for n in sorted(mods) if layer_of(n) == i and mods[n].path.name != "__init__.py"]
        lines.append(f"layer {i}: {', '.join(LAYERS[i])}")
        for n in names:
            deps = sorted({layer_of(d) for d in edges[n]} - {None})
            lines.append(f"  {n:<32} {mods[n].lines:>4} lines  imports layers {deps}")
    return "\n".join(lines)


def code_deps(files: Iterable[str], root: Path) -> list[str]:
    """The shortest list of paths that covers ``files`` exactly: a folder where the stage runs every module in it
    (its subfolders included), else the files one by one."""
    wanted = set(files)

    def whole(folder: Path) -> bool:
        return all(p.relative_to(root).as_posix() in wanted for p in folder.rglob("*.py"))

    out: set[str] = set()
    for f in wanted:
        parts = Path(f).parts
        cover = f
        for i in range(1, len(parts) - 1):  # the highest folder below the package root that is wholly run
            if whole(root.joinpath(*parts[: i + 1])):
                cover = "/".join(parts[: i + 1])
                break
        out.add(cover)
    return sorted(out)


def write_code_deps(root: Path) -> list[str]:
    """Rewrite, in ``dvc.yaml``, each ``citer`` stage's code deps (the ``citer/`` and ``flows/`` entries) to
    :func:`code_deps` of what it runs; the other deps, comments and order of the file stay. Returns the stages
    changed."""
    mods = load_modules(root)
    edges, _ = import_graph(mods)
    runs = stage_code(root, mods, edges)
    spec = root / "dvc.yaml"
    out: list[str] = []
    stage, block, changed = "", None, set()

    def flush() -> None:  # a stage's deps: the others in their order, then the code it runs
        nonlocal block
        if block is not None:
            indent, kept, old = block
            new = code_deps(runs[stage], root) if stage in runs else old
            out.extend(indent + d for d in kept + new)
            if new != old:
                changed.add(stage)
            block = None

    for line in spec.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if block is not None and stripped.startswith("- "):
            code = stage in runs and stripped[2:].startswith(("citer/", "flows/"))
            (block[2] if code else block[1]).append(stripped[2:])
            continue
        flush()
        if line.startswith("  ") and not line.startswith("   ") and stripped.endswith(":"):
            stage = stripped[:-1]
        out.append(line)
        if stripped == "deps:":
            block = (line[: len(line) - len(line.lstrip())] + "  - ", [], [])
    flush()
    spec.write_text("\n".join(out) + "\n", encoding="utf-8")
    return sorted(changed)


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    if sys.argv[1:] == ["--deps"]:
        write_code_deps(root)
        problems = [p for p in check(root) if p.startswith("dvc.yaml")]
        print("\n".join(problems) or "dvc.yaml: every stage's deps cover the code it runs")
        return 1 if problems else 0
    print(describe(root))
    for w in long_modules(root):
        print(f"warning: {w}", file=sys.stderr)
    problems = check(root)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    print("layout holds" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
