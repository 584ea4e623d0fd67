"""The house's shape: packages in layers, no module importing one above it, no import circle.

Every import counts, also those inside functions (a lazy import is still an arrow). Layers are whole packages (no
module of a package sits in another layer than its package), so an arrow between packages runs down or within a
layer, never up. A new package must be given a layer here; an arrow that runs up a layer or closes a circle fails
with the modules named.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvbench": ROOT / "kvbench", "kvbench.methods": ROOT / "methods"}

# lowest first: a package may import its own layer's packages and any below, never one above
LAYERS = [
    ["kvbench", "kvbench.config"],  # KvbenchError, registries, declarative rules, the typed run spec: vocabulary
    ["kvbench.tasks", "kvbench.kernels"],  # examples, prompts and metrics (torch-free facts); torch kernels
    ["kvbench.store"],  # rows on disk, claims, aggregation (torch-free)
    ["kvbench.model"],  # loading, attention statistics, RoPE, cache layers and their bytes
    ["kvbench.methods"],
    ["kvbench.native", "kvbench.engines"],  # kvbench's own engine; the serving engines, in their own processes
    ["kvbench.guide"],  # diagnostics, verdicts, the selection guide
    ["kvbench.report"],  # torch-free: tables, plots, sections, the gate
    ["kvbench.rows"],  # a row's identity: configurations, the run-mode table, the config hash, the row builder
    ["kvbench.preflight"],  # the checks before a run: entrance, model support, model fields (over rows' modes)
    ["kvbench.run"],  # the run executed: the runner, work per example, batches, request workloads
    ["kvbench.plan", "kvbench.integrations"],  # the planner; lm-eval, the Ray launcher
    ["kvbench.serving"],  # a request trace under a KV budget: the engine, the planner's prediction
    ["kvbench.__main__", "kvbench.check", "kvbench.bench"],  # entry points; the benchmarks, over every layer
]


def modules() -> dict[str, Path]:
    out = {}
    for name, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvbench modules `name` imports (the longest known prefix of each imported name)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) - {name} for name, path in mods.items()}


def layer_of(module: str) -> int:
    best, layer = "", -1
    for i, names in enumerate(LAYERS):
        for package in names:
            if (module == package or module.startswith(package + ".")) and len(package) > len(best):
                best, layer = package, i
    assert layer >= 0, f"{module} is in no layer of tests/test_layout.py: give its package one"
    return layer


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


def test_layers_are_whole_packages():
    """Each layer names packages (or top-level modules), never one module of a package: no file-level exception."""
    packages = {name.rsplit(".", 1)[0] for name in modules()} | {"kvbench"}
    singles = [p for layer in LAYERS for p in layer if p not in packages and p.count(".") > 1]
    assert not singles, f"layers name single modules: {singles}"


def test_no_module_imports_one_above_it():
    up = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph().items()
        for b in targets
        if layer_of(b) > layer_of(a) and not (a.startswith(b + ".") or b == "kvbench")
    ]
    assert not up, "imports that run up a layer:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    edges = graph()
    # a package's __init__ importing its own children is how a package exposes them: not a circle
    edges = {a: {b for b in bs if not b.startswith(a + ".") and not a.startswith(b + ".")} for a, bs in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_layout_test_sees_the_house():
    mods = graph()
    assert "kvbench.run.runner" in mods and "kvbench.methods.snapkv" in mods and "kvbench.kernels" in mods
    assert "kvbench.native.engine" in mods["kvbench.run.runner"]


def cpu_backend_importers(edges: dict[str, set[str]]) -> list[str]:
    cpu = "kvbench.kernels.cpu"
    return sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        for b in targets
        if (b == cpu or b.startswith(cpu + ".")) and not (a == cpu or a.startswith(cpu + "."))
    )


def test_only_the_backend_registry_imports_the_cpu_backend():
    """kvbench/kernels/cpu is optional: kvbench/*, methods/* and kernels' own torch code reach it through
    kvbench.kernels.backend only (which loads it by name, None where it is absent), so an install without the folder
    works (tests/kernels/test_backend.py)."""
    assert not cpu_backend_importers(graph()), "\n".join(cpu_backend_importers(graph()))
    assert cpu_backend_importers({"kvbench.native.engine": {"kvbench.kernels.cpu.decode_linear"}})  # it can fail


def test_no_root_folder_shadows_an_installed_package():
    """The repository root is on sys.path wherever kvbench runs from a checkout (pytest, `python -m kvbench`, the
    engine workers' PYTHONPATH), so a root folder named like an installed package hides it: a root `kernels/` hid
    Hugging Face's `kernels`, which transformers imports."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    roots = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert not {name: installed[name] for name in roots & set(installed) if name != "kvbench"}
