"""Architecture rules that keep the package honest (`ARCHITECTURE.md`).

The layers, from the floor up; each imports only from the layers below it (or
from its own package), imports inside functions included:

    cluster, _version   standard library only
    common              shared by the adapters, asks nobody
    keras_compat        every touch of Keras' private API
    faults
    backends            the only code that imports jax, torch or tensorflow
    runtime
    distribution
    layouts             the layout presets, on the distribution's LayoutMap
    planner             its search composes the layout presets into candidates
    training
    checkpoint
    schedules, flops, callbacks
    callback, trainer
    __init__, __main__, cli, cli_plan, cli_search
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_dist"
BACKEND_IMPORT = re.compile(r"^\s*(import|from)\s+(jax|torch|tensorflow)\b", re.M)

LAYERS = [
    {"cluster", "_version"},
    {"common"},
    {"keras_compat"},
    {"faults"},
    {"backends"},
    {"runtime"},
    {"distribution"},
    {"layouts"},
    {"planner"},
    {"training"},
    {"checkpoint"},
    {"schedules", "flops", "callbacks"},
    {"callback", "trainer"},
    {"__init__", "__main__", "cli", "cli_plan", "cli_search"},
]
MAX_LINES = 700


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """`(module imported, name taken from it or "", line)` for every import of
    a keras_dist module in `path`, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [
                (alias.name, "", node.lineno)
                for alias in node.names
                if alias.name.split(".")[0] == "keras_dist"
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "keras_dist":
                found += [(node.module, a.name, node.lineno) for a in node.names]
    return found


def _edges() -> list[tuple[str, str, str, int]]:
    """`(importer, imported module, name, line)`: a `from package import
    module` counts as an import of that module."""
    edges = []
    for importer, path in MODULES.items():
        for module, name, line in _imports(path):
            target = f"{module}.{name}" if f"{module}.{name}" in MODULES else module
            edges.append((importer, target, name, line))
    return edges


def _part(module: str) -> str:
    """The first name below `keras_dist` (`"backends"`, `"cli"`, ...);
    `"__init__"` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    part = _part(module)
    for index, names in enumerate(LAYERS):
        if part in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add {part!r} to LAYERS")


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        _layer(module)


def _upward_imports() -> list[str]:
    return [
        f"{importer}:{line} imports {target}"
        for importer, target, _, line in _edges()
        if _part(importer) != _part(target) and _layer(target) > _layer(importer)
    ]


def test_each_layer_imports_only_from_the_layers_below_it():
    """No upward import, lazy ones included: what two layers both need
    moves below both (the swapped-axes rule that the layout presets and the
    planner read lives in `distribution/swapped_axes.py`)."""
    upward = _upward_imports()
    assert upward == [], (
        f"{len(upward)} import(s) run up the layers (LAYERS in this file): "
        f"{upward}. Move what both modules need into a layer below both."
    )


def test_backends_import_only_common_keras_compat_cluster_and_faults():
    allowed = {"backends", "common", "keras_compat", "cluster", "faults"}
    offenders = [
        f"{importer}:{line} imports {target}"
        for importer, target, _, line in _edges()
        if _part(importer) == "backends" and _part(target) not in allowed
    ]
    assert offenders == []


def test_common_and_cluster_import_nothing_above_them():
    offenders = [
        f"{importer}:{line} imports {target}"
        for importer, target, _, line in _edges()
        if (_part(importer) == "common" and _part(target) != "common")
        or (_part(importer) == "cluster" and _part(target) != "cluster")
    ]
    assert offenders == []


def test_cluster_imports_only_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for module, path in MODULES.items():
        if _part(module) != "cluster":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and not name.startswith("keras_dist.cluster"):
                    offenders.append(f"{module}:{node.lineno} imports {name}")
    assert offenders == []


def test_no_module_imports_a_private_name_of_another():
    offenders = [
        f"{importer}:{line} imports {name} from {target}"
        for importer, target, name, line in _edges()
        if name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
        and target != importer
    ]
    assert offenders == []


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for importer, target, _, _ in _edges():
        if target in MODULES and target != importer:
            graph[importer].add(target)
    # A package's __init__ that re-exports its modules is not a cycle with
    # them: a module importing a sibling through the package imports the
    # sibling (`_edges` resolves it), never the package's other names.
    cycles = [
        component for component in _strongly_connected(graph) if len(component) > 1
    ]
    assert cycles == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


ARCHITECTURE_PAGE = PACKAGE.parent / "docs" / "architecture.md"
# A line of the package tree: its indent (two spaces a folder deep), then a
# folder ("planner/") or a module ("plan.py") and its line of purpose; any
# other line continues the purpose above it.
TREE_ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+(?:/|\.py))(?:\s|$)")


def _modules_named_on_the_architecture_page(text: str) -> set[str]:
    """The modules (`planner/plan.py`, relative to `keras_dist/`) that the
    package tree of `docs/architecture.md` (the text block under "## The
    package") names, each folder's modules indented under it."""
    section = text.split("## The package", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, folder), the open ones
    for line in block.splitlines():
        match = TREE_ENTRY.match(line)
        if match is None:
            continue
        indent, name = len(match["indent"]), match["name"]
        if indent not in {0} | {folder_indent + 2 for folder_indent, _ in folders}:
            continue  # a purpose continued, at its own column
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if name.endswith("/"):
            folders.append((indent, name))
            continue
        path = "".join(folder for _, folder in folders) + name
        named.add(path.removeprefix("keras_dist/"))
    return named


def _package_modules() -> set[str]:
    return {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }


def test_reading_the_package_tree_follows_the_folders():
    text = (
        "## The package\n\n```text\nkeras_dist/\n  cli.py   the command\n"
        "  planner/   plans\n    plan.py   kd.plan,\n              still.py\n"
        "  backends/\n    jax/\n      adapter.py  x\n    base.py  y\n"
        "  _version.py\n```\nplan.py outside the block\n"
    )
    assert _modules_named_on_the_architecture_page(text) == {
        "cli.py",
        "planner/plan.py",
        "backends/jax/adapter.py",
        "backends/base.py",
        "_version.py",
    }


def test_the_architecture_page_names_every_module_of_the_package():
    named = _modules_named_on_the_architecture_page(ARCHITECTURE_PAGE.read_text())
    modules = _package_modules()
    missing = sorted(modules - named)
    assert missing == [], (
        f"docs/architecture.md's package tree (the block under '## The package') "
        f"does not name {len(missing)} module(s) of keras_dist/: {missing}. Add "
        "one line for each under its folder, indented two spaces deeper than "
        "the folder: the file name, then its purpose in a few words (from the "
        "module's docstring), e.g. '    plan.py   kd.plan: where every variable "
        "goes'."
    )
    gone = sorted(named - modules - {"__init__.py", "__main__.py"})
    assert gone == [], (
        f"docs/architecture.md's package tree names {gone}, which keras_dist/ "
        "does not have: remove or rename those lines."
    )


def test_modules_stay_small():
    long = {
        module: lines
        for module, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_only_each_backends_own_modules_import_it():
    # jax, torch and tensorflow are imported only by the modules of the backend
    # subpackage named for them (backends/jax/, backends/torch/,
    # backends/tensorflow/), each only its own.
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {match.group(2)}"
        for path in PACKAGE.rglob("*.py")
        for match in BACKEND_IMPORT.finditer(path.read_text())
        if path.parent != PACKAGE / "backends" / match.group(2)
    ]
    assert offenders == []


def test_import_keras_dist_alone_imports_neither_keras_nor_a_backend_nor_ray():
    """Without simulated devices, `import keras_dist` (the CLI, the launcher)
    starts at once; the public API loads Keras on first use. Ray and
    Kubernetes belong to `integrations/`, installed as extras: never imported
    (one process for both checks: each start-up costs seconds)."""
    code = (
        "import sys, keras_dist, keras_dist.cluster, keras_dist.cli; "
        "loaded = lambda names: sorted(m for m in names if m in sys.modules); "
        "heavy = ('keras', 'jax', 'torch', 'tensorflow'); "
        "print(loaded(heavy)); keras_dist.DataParallel; print(loaded(heavy)); "
        "print(loaded(('ray', 'kubernetes', 'kubernetes_validate', "
        "'keras_dist_ray')))"
    )
    environment = {
        name: value
        for name, value in os.environ.items()
        if name != "KERAS_DIST_CPU_DEVICES"
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, integrations = done.stdout.strip().splitlines()[-3:]
    assert before == "[]"
    assert "'keras'" in after
    assert integrations == "[]"


def test_keras_private_imports_stay_in_the_compat_modules():
    allowed = {
        "backends/jax/keras_internals.py",
        "backends/torch/keras_internals.py",
        "backends/tensorflow/keras_internals.py",
        "backends/tensorflow/keras_steps.py",
    }
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "keras.src" in path.read_text()
        and path.relative_to(PACKAGE).as_posix() not in allowed
        and path.relative_to(PACKAGE).parts[0] != "keras_compat"
    ]
    assert offenders == []


def test_importing_the_package_patches_keras_in_one_place():
    """Rule 7: what importing keras_dist patches is applied by
    `keras_compat.patch_keras`, called once, from one module."""
    callers = [
        module
        for module, path in MODULES.items()
        if "patch_keras(" in path.read_text() and _part(module) != "keras_compat"
    ]
    assert callers == ["keras_dist.training.session"]


def test_no_pass_bodies_in_the_package():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s+pass\s*$", path.read_text(), re.M)
    ]
    assert offenders == []


def test_cli_devices_reports_this_process():
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", "devices", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    line = result.stdout.strip().splitlines()[-1]
    assert '"num_processes": 1' in line and '"devices": ["' in line


def test_cli_launch_runs_the_script_once_per_rank(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import os\nprint('world size', os.environ['WORLD_SIZE'])\n")
    command = [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[rank 0] world size 2",
        "[rank 1] world size 2",
    ]
