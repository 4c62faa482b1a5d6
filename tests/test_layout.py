"""The layout rules of docs/architecture.md as tests: no import cycle among the project's
modules, counting imports under `if TYPE_CHECKING:` (a cycle hidden from the interpreter is
still one concern split over two files). Module length is not a rule: a long module is a
smell to think about, and splitting one to meet a count made a mixin that borrows another
class's private state (services/worker/control/moves.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services", "plugins", "harness", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {
        module_name(path): path for top in PACKAGES for path in sorted((ROOT / top).rglob("*.py"))
    }


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, wherever the import statement is (module level,
    in a function, under TYPE_CHECKING). `from a.b import c` names `a.b.c` when that is a
    module, else `a.b`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` also runs a and a.b; the edge that matters is to the module named
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_inits(modules: dict[str, Path]) -> set[str]:
    return {name for name, path in modules.items() if path.name == "__init__.py"}


def test_no_import_cycle_among_our_modules_type_checking_included():
    modules = all_modules()
    inits = package_inits(modules)
    # A package's __init__ that re-exports its submodules is its facade, not a participant:
    # an edge from a submodule up to its own package's __init__ is a layering bug only
    # when the __init__ is not a pure facade, so edges *into* a facade from inside it are
    # reported, and re-export edges out of it are not counted.
    graph = {
        name: {
            target
            for target in imports_of(name, path, modules)
            if not (name in inits and target.startswith(name + "."))
        }
        for name, path in modules.items()
    }
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_hidden_under_type_checking(tmp_path, monkeypatch):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "app.py").write_text("from pkg.conn import Conn\n")
    (package / "conn.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.app import App\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(package.rglob("*.py"))}
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == [["pkg.app", "pkg.conn"]]


# ---------------------------------------------------------------- seams, state, commands

#: class decorators and bases under which bare annotations are fields or an interface's
#: attributes, not borrowed state
_FIELD_CLASSES = ("dataclass", "NamedTuple", "TypedDict", "Struct", "ABC", "Protocol")


def _names(nodes: list[ast.expr]) -> set[str]:
    found = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                found.add(sub.attr)
    return found


def service_trees() -> list[tuple[Path, ast.Module]]:
    return [
        (path, ast.parse(path.read_text(), filename=str(path)))
        for path in sorted((ROOT / "services").rglob("*.py"))
    ]


def borrowed_state(tree: ast.Module) -> list[str]:
    """Classes whose body declares attributes by bare annotation without being a dataclass,
    a record type or an interface: the shape of a mixin that borrows its host's state."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        if _names(node.decorator_list + node.bases) & set(_FIELD_CLASSES):
            continue
        bare = [
            stmt.target.id
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign)
            and stmt.value is None
            and isinstance(stmt.target, ast.Name)
        ]
        if bare:
            found.append(f"{node.name}: {', '.join(bare)}")
    return found


def untyped_commands(tree: ast.Module) -> list[str]:
    """Parameters and fields that carry a command (by name) annotated `Any`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            name, annotation = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, annotation = node.target.id, node.annotation
        else:
            continue
        if "command" in name and annotation is not None and "Any" in _names([annotation]):
            found.append(f"{name} (line {node.lineno})")
    return found


def probed_seams(tree: ast.Module) -> list[str]:
    """`getattr(self.<collaborator>..., "name", ...)`: a seam found by probing, where an
    ABC or an isinstance check says what the collaborator can do."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and isinstance(node.args[0], ast.Attribute)
        ):
            base = node.args[0]
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "self":
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mixin_borrows_another_class_state_in_services():
    offenders = {
        str(path.relative_to(ROOT)): found
        for path, tree in service_trees()
        if (found := borrowed_state(tree))
    }
    assert offenders == {}


def test_no_command_is_typed_any_in_services():
    offenders = {
        str(path.relative_to(ROOT)): found
        for path, tree in service_trees()
        if (found := untyped_commands(tree))
    }
    assert offenders == {}


def test_no_seam_is_found_by_getattr_probing_in_services():
    offenders = {
        str(path.relative_to(ROOT)): found
        for path, tree in service_trees()
        if (found := probed_seams(tree))
    }
    assert offenders == {}


def test_the_checks_see_a_mixin_an_any_command_and_a_probe():
    tree = ast.parse(
        "from typing import Any\n"
        "class Moves:\n"
        "    _runners: dict\n"
        "    def bind(self, command: Any) -> None:\n"
        "        attach = getattr(self.sink, 'attach_host', None)\n"
        "@dataclasses.dataclass\n"
        "class Record:\n"
        "    runner: object\n"
    )
    assert borrowed_state(tree) == ["Moves: _runners"]
    assert untyped_commands(tree) == ["command (line 4)"]
    assert probed_seams(tree) == ["line 5: getattr(self.sink, 'attach_host', None)"]
