"""The package's shape: public names that are not module names, no import cycles, no module
reaching into another's private names."""
import ast
import importlib
import importlib.util
import pathlib

import mpgraph

ROOT = pathlib.Path(__file__).resolve().parent.parent
# where each installed package's files are (pyproject maps mpgraph.passes to the top-level passes/)
PACKAGES = {"mpgraph": ROOT / "mpgraph", "mpgraph.passes": ROOT / "passes"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg] + parts)
            if not name.startswith("mpgraph.passes.") or pkg == "mpgraph.passes":
                found[name] = path
    return found


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every mpgraph import in the file, lazy ones too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "mpgraph":
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "mpgraph"]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (write mpgraph.<stage>.<module>)")
    return out


def test_no_public_name_hides_a_module():
    for name in mpgraph.__all__:
        assert importlib.util.find_spec(f"mpgraph.{name}") is None, name
    import mpgraph.plans.plan as plan_module
    import mpgraph.frontend.capture as capture_module
    assert plan_module.Plan is mpgraph.Plan and capture_module.capture is mpgraph.capture
    assert callable(mpgraph.plan) and callable(mpgraph.capture)


def test_stage_folders_import_and_hold_what_their_names_say():
    for stage in ("frontend", "ir", "passes", "cost", "plans", "tools"):
        module = importlib.import_module(f"mpgraph.{stage}")
        assert module.__doc__, stage
    modules = _modules()
    assert "mpgraph.passes.infra" in modules and "mpgraph.passes.op_table" in modules
    assert "mpgraph.cost.mincut" in modules and "mpgraph.tools.onnx_export" in modules


def test_no_import_cycles_between_modules():
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        if name in ("mpgraph", "mpgraph.passes"):
            continue  # package fronts re-export; what they import is not a dependency of a stage
        targets = set()
        for module, names in _imports(name, path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                if target in modules and target != name and target not in ("mpgraph", "mpgraph.passes"):
                    targets.add(target)
        edges[name] = targets
    state = {}

    def visit(n, stack):
        state[n] = "open"
        for m in edges.get(n, ()):
            if state.get(m) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in edges:
        if n not in state:
            visit(n, [n])


def test_no_module_imports_another_modules_private_names():
    for name, path in _modules().items():
        for module, names in _imports(name, path):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{name} imports {private} from {module}"


# the stages, lowest first: each imports only those before it (lazy imports included)
LAYERS = ["mpgraph.ir", "mpgraph.cost", "mpgraph.passes", "mpgraph.frontend", "mpgraph.plans",
          "mpgraph.api", "mpgraph.tools"]
BASE = {"mpgraph.errors", "mpgraph.numerics"}  # leaf modules every stage may use


def _stage(module: str):
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def test_stage_packages_import_only_the_stages_below_them():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        here = _stage(name)
        if here is None or name == "mpgraph.passes":
            continue
        for module, names in _imports(name, path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                there = _stage(target)
                if there is not None and there != here and \
                        LAYERS.index(there) > LAYERS.index(here):
                    wrong.append(f"{name} imports {target} ({there} is above {here})")
    assert not wrong, "\n".join(sorted(set(wrong)))
