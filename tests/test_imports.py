"""The package's import graph, read from the code (AST): no cycles among msa_codegen modules, and
the core asks the tuning package only through its lookup module.

Every ``import`` counts, at module level or inside a function (a deferred import is still a
dependency), except under ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs the packages
``a.b`` and ``a`` first: those edges count too, except to the root package ``msa_codegen`` (the
public facade, which every submodule import runs first and which imports the API) and to the
importer's own packages (already running when it is imported).
"""
from __future__ import annotations

import ast
from pathlib import Path

import msa_codegen

ROOT = Path(msa_codegen.__file__).resolve().parent
PKG = "msa_codegen"

#: modules outside the core: the tuning database and tuner, the command lines, the benchmark
#: drivers, integrations with other libraries, and the root facade (it installs the autotuner)
NOT_CORE = ("msa_codegen.tuning", "msa_codegen.tuner", "msa_codegen.cli", "msa_codegen.bench",
            "msa_codegen.integrations")
#: what the core may import from tuning: the lookup module (and its package, which runs first)
CORE_MAY_IMPORT = {"msa_codegen.tuning", "msa_codegen.tuning.lookup"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(module: str, node, modules) -> list[str]:
    """The msa_codegen modules an import statement of ``module`` loads."""
    targets = []
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if _is_package(module, modules) else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        for alias in node.names:
            sub = f"{prefix}.{alias.name}"
            targets.append(sub if sub in modules else prefix)
    out = []
    for t in targets:
        if not (t == PKG or t.startswith(PKG + ".")):
            continue
        while t not in modules:   # `import msa_codegen.x.y` where y is a name: its module
            t = t.rpartition(".")[0]
        out.append(t)
        parent = t.rpartition(".")[0]
        while parent and parent != PKG:   # the packages that run first (not the importer's own:
            if not (module + ".").startswith(parent + "."):   # those are running already)
                out.append(parent)
            parent = parent.rpartition(".")[0]
    return out


def _type_checking_nodes(tree) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                edges.update(_resolve(name, node, modules))
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "msa_codegen.tuning.lookup" in graph["msa_codegen.plan"]
    assert "msa_codegen.kernels.launch" in graph["msa_codegen.autograd"]
    assert "msa_codegen.pattern.spec" in graph["msa_codegen.heuristics"]


def test_no_import_cycles():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_sees_tuning_only_through_lookup():
    graph = import_graph()
    core = [m for m in graph if m != PKG and not m.startswith(NOT_CORE)]
    assert "msa_codegen.plan" in core and "msa_codegen.api" in core
    bad = {m: sorted(t for t in graph[m] if t.startswith("msa_codegen.tuning") and t not in CORE_MAY_IMPORT)
           for m in core}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


def test_lookup_module_imports_no_database_layer_at_module_level():
    """The core's one tuning module loads without SQLAlchemy: its database imports are deferred
    until a database file exists."""
    tree = ast.parse((ROOT / "tuning" / "lookup.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {ast.unparse(n) for n in top}
    assert not any("database" in n or "sqlalchemy" in n or "models" in n for n in names), names
