"""The import rules of architecture.md section 3, checked two ways: by reading
every import statement, and by importing the package in a clean interpreter and
looking at what got loaded. Also the rules of the repository's other packages: tests/
and bench/ share harness/; bench never imports tests; the product imports none of them."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_TOP_LEVEL = ("shared", "services", "plugins")
# Not in the wheel: run from a checkout (pytest and `python -m bench.X` from the root).
CHECKOUT_ONLY = ("harness", "tests", "bench")


def imports_of(package: str, tops: tuple[str, ...] = OUR_TOP_LEVEL) -> set[str]:
    """Every module under the top-level names `tops` named by an import statement under
    `package` (absolute imports: a relative one stays inside `package`)."""
    found: set[str] = set()
    folder = ROOT / package.replace(".", "/")
    assert folder.is_dir(), folder
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.update(n for n in names if n.split(".")[0] in tops)
    return found


def loaded_by(module: str) -> set[str]:
    code = (
        f"import sys, {module}; "
        f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {OUR_TOP_LEVEL!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


#: the leaf module of the one coded-error base (it imports nothing): every package may use it
LEAF = "shared.errors"


def test_realtime_imports_nothing_else_of_ours():
    allowed = ("shared.protocol.realtime", LEAF)
    assert all(m.startswith(allowed) for m in imports_of("shared.protocol.realtime"))
    loaded = loaded_by("shared.protocol.realtime")
    assert loaded - {"shared", "shared.protocol"} == {m for m in loaded if m.startswith(allowed)}


def test_the_error_base_imports_nothing_of_ours():
    assert loaded_by(LEAF) == {"shared", LEAF}


def test_duplex_imports_only_realtime():
    allowed = ("shared.protocol.realtime", "shared.protocol.duplex", LEAF)
    assert all(m.startswith(allowed) for m in imports_of("shared.protocol.duplex"))
    loaded = loaded_by("shared.protocol.duplex") - {"shared", "shared.protocol"}
    assert loaded and all(m.startswith(allowed) for m in loaded)


def test_shared_imports_nothing_outside_shared():
    assert all(m.split(".")[0] == "shared" for m in imports_of("shared"))


def test_only_the_protocol_package_touches_the_realtime_half():
    """Everything outside shared/protocol goes through the duplex door."""
    for package in ("services", "plugins", "shared.contracts", "shared.redis", "shared.client"):
        assert not any(m.startswith("shared.protocol.realtime") for m in imports_of(package)), (
            package
        )


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("services.api", ("services.worker", "plugins")),
        ("services.worker", ("services.api",)),
        ("plugins", ("services",)),
    ],
)
def test_service_boundaries(package, forbidden):
    assert not any(m.startswith(forbidden) for m in imports_of(package))


#: The worker's three places (docs/architecture.md, "The worker pod"), each importing only
#: downward: the control plane owns the sessions this worker holds and builds their engines,
#: the session engine is one session's state and how it reacts, the stages run the models.
#: Of `services`, each imports only what is named here; the process (services/worker/*.py:
#: the composition root, the inbox reader, the publisher, the drain...) stands above all
#: three, and none of them imports it.
WORKER_LAYERS = {
    "services.worker.control": (
        "services.worker.control",
        "services.worker.engine",
        "services.worker.stages",
    ),
    "services.worker.engine": ("services.worker.engine",),
    "services.worker.stages": ("services.worker.stages",),
}


def _outside(modules: set[str], allowed: tuple[str, ...]) -> set[str]:
    """The `services` modules of `modules` in none of the packages `allowed` (the parent
    packages a submodule's import runs, `services` and `services.worker`, aside)."""
    return {
        m
        for m in modules
        if m.split(".")[0] == "services"
        and m not in ("services", "services.worker")
        and not any(m == a or m.startswith(a + ".") for a in allowed)
    }


def loaded_by_package(package: str) -> set[str]:
    """What importing every module of `package`, in a clean interpreter, loads of ours."""
    code = (
        f"import importlib, pkgutil, sys, {package} as package\n"
        "for module in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "    importlib.import_module(module.name)\n"
        f"print('\\n'.join(m for m in sys.modules if m.split('.')[0] in {OUR_TOP_LEVEL!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


@pytest.mark.parametrize("package", sorted(WORKER_LAYERS))
def test_the_worker_layers_import_only_downward(package):
    """The session engine never imports the control plane (nor the stages: it reaches its
    stage through the `StagePort` of shared.contracts); the stages import neither the engine
    nor the control plane; the control plane imports the engine and the stages, never the
    process above it. By every import statement, and by what importing them loads."""
    allowed = WORKER_LAYERS[package]
    imported = _outside(imports_of(package), allowed)
    assert not imported, f"{package} imports {sorted(imported)}"
    loaded = loaded_by_package(package)
    assert any(m.startswith(package + ".") for m in loaded), loaded
    assert not _outside(loaded, allowed), f"{package} loads {sorted(_outside(loaded, allowed))}"


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("bench", ("tests",)),
        ("harness", ("tests", "bench")),
        *((product, CHECKOUT_ONLY) for product in OUR_TOP_LEVEL),
    ],
    ids=["bench", "harness", *OUR_TOP_LEVEL],
)
def test_harness_boundaries(package, forbidden):
    """tests/ and bench/ both import harness/; bench never imports tests, the harness imports
    neither, and the product (what the wheel ships) imports none of the three."""
    found = imports_of(package, tops=forbidden)
    assert not found, f"{package} imports {sorted(found)}"


def test_bench_and_harness_load_no_tests():
    """Every module of bench/ and harness/, imported in a clean interpreter from the repository
    root (as `python -m bench.X` runs), loads nothing of tests/."""
    code = (
        "import importlib, pkgutil, sys, bench, harness\n"
        "for package in (bench, harness):\n"
        "    for module in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(module.name)\n"
        "print('\\n'.join(sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(out.stdout.split())
    assert "bench.common" in loaded and "harness.processes" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "tests"}


def test_no_typing_protocol_seams():
    """Seams are ABCs (seed rule 6), never typing.Protocol."""
    for top in OUR_TOP_LEVEL:
        for path in (ROOT / top).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module in (
                    "typing",
                    "typing_extensions",
                ):
                    assert "Protocol" not in {a.name for a in node.names}, path
                if isinstance(node, ast.Attribute) and node.attr == "Protocol":
                    assert not (isinstance(node.value, ast.Name) and node.value.id == "typing"), (
                        path
                    )
