"""The imports point down the layers, and go round in no circle.

The layers, each importing only from those on its left:
mqsite ← queues ← subscribers ← delivery ← dashboard, analytics.
`mqsite/` is the plumbing and the composition root: only its settings, urls, asgi and celery
modules, and an app's AppConfig.ready() (where a higher app registers its listeners), may import
upwards. Every import counts, at module level or inside a function, since a function-level import
that goes up is a dependency all the same, only hidden.
"""

import ast
import pathlib

# The repository: the folder of manage.py, wherever in tests/ this file is.
ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "manage.py").exists())

LAYERS = {"mqsite": 0, "queues": 1, "subscribers": 2, "delivery": 3, "dashboard": 4, "analytics": 4}

COMPOSITION_ROOT = {"mqsite.settings", "mqsite.urls", "mqsite.asgi", "mqsite.celery"}


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def app_modules():
    """{dotted name: path} of every module of the layered apps, migrations included."""
    found = {}
    for app in LAYERS:
        for path in sorted((ROOT / app).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(name, path):
    """(imported dotted name, in a ready() hook) for every import the module makes, at any
    depth: `import a.b`, `from a import b`, `from . import b`, importlib.import_module("a.b")."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, in_ready):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "ready":
            in_ready = path.name == "apps.py"
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_ready) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            found.append((source, in_ready))
            # `from a import b` imports the module a.b when there is one.
            found.extend((f"{source}.{alias.name}", in_ready) for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, in_ready))
        for child in ast.iter_child_nodes(node):
            visit(child, in_ready)

    visit(tree, False)
    return found


def graph():
    """{module: {imported module: whether only from a ready() hook}} among the apps' modules.
    Importing a.b.c runs the packages a and a.b first: those are edges too."""
    modules = app_modules()
    edges = {name: {} for name in modules}
    for name, path in modules.items():
        for target, in_ready in imports_of(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    edges[name][prefix] = edges[name].get(prefix, True) and in_ready
    return edges


def upward_imports(edges):
    bad = []
    for source, targets in edges.items():
        if source in COMPOSITION_ROOT:
            continue
        app = source.split(".")[0]
        for target, in_ready in targets.items():
            if any(t.startswith(target + ".") for t in targets):
                continue  # the package of a module imported: one import, said once
            other = target.split(".")[0]
            if other != app and LAYERS[other] >= LAYERS[app] and not in_ready:
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def circles(edges):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The walk counts what a regex of the module's head would miss."""
    path = tmp_path / "probe.py"
    path.write_text(
        "import a.b\n"
        "from . import sibling\n"
        "from ..up import thing\n"
        "def f():\n"
        "    from delivery import ledger\n"
        "    importlib.import_module('dashboard.views')\n"
        "class C:\n"
        "    def ready(self):\n"
        "        import x\n"
    )
    found = set(imports_of("pkg.sub.probe", path))
    assert ("a.b", False) in found
    assert ("pkg.sub.sibling", False) in found
    assert ("pkg.up.thing", False) in found
    assert ("delivery.ledger", False) in found
    assert ("dashboard.views", False) in found
    assert ("x", False) in found  # ready() counts only in an apps.py


def test_the_checker_walks_the_whole_tree():
    """Not a vacuous pass: every app is read, function-level imports included."""
    edges = graph()
    assert {name.split(".")[0] for name in edges} == set(LAYERS)
    assert len(edges) > 150
    assert "queues.models" in edges["delivery.ledger"]
    assert "mqsite.readers" in edges["analytics.apps"]  # from inside ready()


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_points_up_the_layers():
    bad = upward_imports(graph())
    assert not bad, f"{len(bad)} imports point up the layers:\n" + "\n".join(bad)
