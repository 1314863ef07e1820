"""The layer check: no module imports a higher layer, and module imports have no cycles.

`python -m detaudit.devtools.imports` prints every violation and exits 1 (0 when clean). Imports are
read from the source (`ast`), lazy imports inside functions included: a function-level import of a
higher layer is still a dependency on it. The layer order is the one in docs/architecture.md.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent

# lowest first; a module may import its own layer and the ones below it. An entry names a top-level module
# or package of detaudit, or a subpackage ("backends.kernels"), which then is a layer of its own: a
# module belongs to the longest entry its dotted name starts with
LAYERS: list[tuple[str, ...]] = [
    # (__init__, inputs, runs, analysis: the packages' docstring-only __init__)
    ("errors", "paths", "omp_wait", "compiling", "__init__", "inputs", "runs", "analysis"),
    (
        "config",
        "runs.records",
        "runs.manifest",
        "runs.fingerprint",
        "analysis.metrics",
        "inputs.grading",
        "inputs.suite_yaml",
        "inputs.suite_render",
        "inputs.suite_paths",
        "inputs.user_files",
        "inputs.prompt_limits",
        "decoding",
        "synthetic",
        "progress",
        "workers",
    ),
    ("backends.kernels",),
    ("inputs.suites", "models", "backends", "runs.rundir"),
    ("builtin",),
    ("vllm", "server"),
    ("engines", "analysis.analyze", "analysis.diff", "analysis.load_axis", "analysis.spec_axis", "analysis.tp_axis"),
    ("executors", "inputs.prepare", "render"),
    ("analysis.gate", "analysis.gate_report"),
    ("sweep", "align", "runs.merge", "bench"),
    ("cli", "__main__", "devtools"),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
# layers only some may import, however high the importer: the kernels are the backends' own (a model
# layer asks its backend, which owns its kernels, layouts and collectives); the benchmarks time them
PRIVATE = {"backends.kernels": ("backends", "backends.kernels", "bench")}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = ("detaudit",) + path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, package: Path) -> bool:
    path = package.joinpath(*dotted.split(".")[1:])
    return path.is_dir() or path.with_suffix(".py").exists()


def imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every detaudit module a file imports (`from detaudit import x` counts as detaudit.x)."""
    out: set[str] = set()
    mod = module_name(path, package)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("detaudit")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if base == "detaudit" or base.startswith("detaudit."):  # `from pkg import submodule` is the submodule
                out |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", package) else base for a in node.names}
    return out


def layer(module: str) -> tuple[str, int]:
    parts = module.split(".")[1:] or ["__init__"]
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYER_OF:
            return key, LAYER_OF[key]
    raise SystemExit(f"detaudit.devtools.imports: {module} is in no layer; add {parts[0]!r} to LAYERS")


def check(package: Path = PACKAGE) -> list[str]:
    graph: dict[str, set[str]] = defaultdict(set)
    problems = []
    for path in sorted(package.rglob("*.py")):
        mod = module_name(path, package)
        top, level = layer(mod)
        for dep in sorted(imports(path, package)):
            dep_top, dep_level = layer(dep)
            if dep_level > level:
                problems.append(f"{mod} (layer {level}: {top}) imports {dep} (layer {dep_level}: {dep_top})")
            elif dep_top in PRIVATE and top not in PRIVATE[dep_top]:
                problems.append(f"{mod} (layer {level}: {top}) imports {dep}, a kernel")
            if dep != mod:
                graph[mod].add(dep)
    return problems + [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Elementary cycles found by depth-first search (each reported once, from its smallest module).
    A package's __init__ re-exporting its own submodules is not a cycle worth reporting."""
    found, seen = [], set()

    def edges(m: str) -> list[str]:
        return [d for d in sorted(graph.get(m, ())) if not d.startswith(m + ".")]

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in edges(node):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [start])
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def main() -> None:
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} layer violation(s) or cycle(s)" if problems else "layers ok: no upward import, no cycle")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
