"""Structural rules of the package, checked on its source: no import cycles between
modules, a trainer that never branches on an algorithm's name, no references to
documents outside the repository, and a row in docs/architecture.md for every package and
top-level module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "composer_replication"
ALGORITHM_NAMES = (
    "grpo",
    "max_rl",
    "reward",
    "custom",
    "opd",
    "opsd",
    "sdpo",
    "sft",
    "echo",
    "replay_dpo",
    "composer",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(node: ast.stmt, package: str) -> set[str]:
    """The dotted names an import statement imports (relative ones resolved in ``package``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return {base} | {f"{base}.{a.name}" for a in node.names}


def _package_modules(found: set[str], modules: set[str], this: str) -> set[str]:
    """The package modules behind imported names (a name resolves to its longest module)."""
    out = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != this:
            out.add(name)
    return out


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules imported when ``path`` is imported (module level, not under
    ``TYPE_CHECKING``, not inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            else:
                found.update(_imported_names(node, package))

    visit(tree.body)
    return _package_modules(found, modules, this)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {name: _top_level_imports(path, modules) for name, path in files.items()}
    # Importing a.b.c imports its parent packages first.
    for name in list(graph):
        parent = name.rpartition(".")[0]
        if parent in graph:
            graph[name] = graph[name] | {parent} if parent != name else graph[name]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles_between_modules():
    graph = _graph()
    # A package's __init__ importing its own submodules is not a cycle of concern when the
    # submodule does not import the package back beyond the parent edge added above.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not (name.startswith(d + ".") and d in graph)}
    assert _cycles(graph) == []


def _all_imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports anywhere: at module level, under TYPE_CHECKING or
    inside functions (an import deferred to call time still ties the two modules)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(_imported_names(node, package))
    # a package's __init__ is not a dependency of concern for its own modules
    return {m for m in _package_modules(found, modules, this) if not this.startswith(m + ".")}


def _full_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _all_imports(path, set(files)) for name, path in files.items()}


def test_no_import_cycles_even_through_imports_inside_functions():
    assert _cycles(_full_graph()) == []


#: The package's layers, bottom first, as the data flows: settings and plain helpers;
#: sandboxes and the safety checks; samples and their loss components; the policy model; the
#: loss math; episodes (environments, the agent loop, inference engines); what turns
#: episodes into training signal (algorithms, evaluations, traces, task generation); the
#: training loops and backends; the commands. A module imports only modules of its own layer
#: or below, at module level or inside a function. Names are module prefixes under the
#: package; a ``cli`` module of any package is a command (the top layer).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        ("_moved", "common", "config", "hint_generator", "integrations", "testing"),
    ),
    ("isolation", ("sandbox", "safety")),
    ("samples", ("samples",)),
    ("model", ("model",)),
    ("losses", ("ops", "loss", "batch", "opsd", "chunked_head", "distillation")),
    ("episodes", ("envs", "rollout", "roles", "inference")),
    ("signals", ("algo", "evals", "traces", "datagen")),
    (
        "training",
        ("distributed", "diloco", "training", "backends", "preflight", "recipes"),
    ),
    ("commands and faces", ("cli", "__main__", "smoke", "trainer", "")),
)


def _layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a module (``composer_replication.x.y``)."""
    name = module.removeprefix("composer_replication").removeprefix(".")
    if name.split(".")[-1] == "cli":
        return len(LAYERS) - 1
    best, layer = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or (prefix and name.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, layer = len(prefix), index
    if layer is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return layer


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({LAYERS[_layer_of(module)][0]}) imports {dep} ({LAYERS[_layer_of(dep)][0]})"
        for module, deps in graph.items()
        for dep in deps
        if _layer_of(dep) > _layer_of(module)
    )


def _unit(module: str) -> str:
    """The top-level package or root module ``composer_replication.x...`` belongs to."""
    return ".".join(module.split(".")[:2])


def _unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each module replaced by its top-level package or root module."""
    units: dict[str, set[str]] = {}
    for module, deps in graph.items():
        unit = _unit(module)
        units.setdefault(unit, set()).update(_unit(d) for d in deps if _unit(d) != unit)
    return units


def _mutual_pairs(units: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        {tuple(sorted((a, b))) for a, deps in units.items() for b in deps if a in units.get(b, ())}
    )


def test_packages_and_root_modules_import_one_way():
    """Folders are layers too: no two top-level packages (or root modules) import each
    other, type-only and deferred imports included, and no longer chain closes a loop."""
    units = _unit_graph(_full_graph())
    assert _mutual_pairs(units) == []
    assert _cycles(units) == []


def test_the_package_check_sees_two_packages_importing_each_other():
    graph = {
        "composer_replication.trainer": {"composer_replication.backends.trl.run"},
        "composer_replication.backends.trl.run": {"composer_replication.trainer.loop"},
        "composer_replication.roles": {"composer_replication.samples.rollouts"},
    }
    units = _unit_graph(graph)
    assert _mutual_pairs(units) == [
        ("composer_replication.backends", "composer_replication.trainer")
    ]
    assert _cycles(units) == [["composer_replication.backends", "composer_replication.trainer"]]


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    stack = [m for m in graph if m == start or m.startswith(start + ".")]
    while stack:
        for dep in graph.get(stack.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


@pytest.mark.parametrize(
    ("module", "never"),
    [
        # task generation needs no trainer code
        ("datagen", ("training", "trainer", "backends", "preflight")),
        # the sampler knows no environment: it reaches one through the roles' protocols
        ("rollout.env_sampler", ("envs",)),
        # evaluation and the report are called by the lifecycle and import nothing of it
        ("evals.heldout", ("training", "trainer", "backends")),
        ("training.report", ("training.lifecycle", "training.loop", "backends")),
        # the native loop never reaches the trl backend or its face
        ("training", ("backends", "trainer")),
    ],
)
def test_what_a_component_never_reaches(module, never):
    reached = _reaches(_full_graph(), f"composer_replication.{module}")
    bad = sorted(
        r
        for r in reached
        for n in never
        if r == f"composer_replication.{n}" or r.startswith(f"composer_replication.{n}.")
    )
    assert bad == [], f"{module} reaches {bad}"


#: what the package root holds: its entry points, the seed API's faces and the commands
ROOT_MODULES = {
    "__init__": "entry point: the seed API's names, lazily",
    "__main__": "entry point: python -m composer_replication",
    "_moved": "entry point: earlier and seed module paths",
    "cli": "command: the typer app",
    "smoke": "command: smoke",
    "preflight": "the commands' checks before work starts",
    "loss": "seed face over ops/",
    "batch": "seed face over ops/",
    "opsd": "seed face over ops/",
    "chunked_head": "seed face over ops/",
    "hint_generator": "seed module: hint templates",
    "roles": "face: the roles' protocols",
}


def test_the_package_root_holds_only_faces_commands_and_entry_points():
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules - set(ROOT_MODULES) == set(), "a utility at the root: move it to its layer"


#: the modules that may take the whole run config: its definition, the controllers that
#: hand each component its sections, the backends and recipes that build whole runs, and
#: the commands
WHOLE_CONFIG_READERS = (
    "config",
    "training.loop",
    "training.lifecycle",
    "training.replica",
    "backends",
    "recipes",
    "cli",
    "preflight",
)


def _takes_run_config(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.ImportFrom) and any(a.name == "RunConfig" for a in node.names)
        for node in ast.walk(tree)
    )


def test_no_component_below_the_controllers_takes_the_whole_run_config():
    readers = sorted(
        _module_name(path).removeprefix("composer_replication.")
        for path in PACKAGE.rglob("*.py")
        if _takes_run_config(path)
    )
    allowed = [
        r for r in readers if any(r == p or r.startswith(p + ".") for p in WHOLE_CONFIG_READERS)
    ]
    assert readers == allowed, "pass the component its config sections, not the RunConfig"


def test_no_module_imports_a_higher_layer():
    assert _upward_imports(_full_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {
        "composer_replication.samples.wire": {"composer_replication.training.loop"},
        "composer_replication.training.loop": {"composer_replication.samples.wire"},
        "composer_replication.datagen.cli": {"composer_replication.preflight"},
    }
    assert _upward_imports(graph) == [
        "composer_replication.samples.wire (samples) imports composer_replication.training.loop "
        "(training)"
    ]


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


@pytest.mark.parametrize(
    "module",
    ["training/loop.py", "training/lifecycle.py", "training/runtime.py", "training/step.py"],
)
def test_the_trainer_never_names_an_algorithm(module):
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not (strings & set(ALGORITHM_NAMES)), f"{module} branches on an algorithm name"


def test_no_citation_of_documents_outside_the_repository():
    hits = []
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parents[1] / "docs").glob("*.md")]:
        text = path.read_text(encoding="utf-8")
        for needle in ("01-api", "02-algorithms", "03-safety", "../shared"):
            if needle in text:
                hits.append(f"{path.name}: {needle}")
    assert hits == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "composer_replication.ingestion.claude_code",
            "composer_replication.traces.ingestion.claude_code",
        ),
        ("composer_replication.teacher_replay", "composer_replication.traces.teacher_replay"),
        (
            "composer_replication.teacher_replay.replay",
            "composer_replication.traces.teacher_replay.replay",
        ),
        (
            "composer_replication.replaysim.normalize",
            "composer_replication.traces.replaysim.normalize",
        ),
        ("composer_replication.trace_cli", "composer_replication.traces.cli"),
        ("composer_replication.datagen.sandbox", "composer_replication.sandbox"),
        ("composer_replication.datagen.docker_sandbox", "composer_replication.sandbox.docker"),
        ("composer_replication.trainer.ranks", "composer_replication.distributed.ranks"),
        ("composer_replication.trainer.components", "composer_replication.ops.token_losses"),
        ("composer_replication.datagen.fd_tasks", "composer_replication.envs.fd_tasks"),
        ("composer_replication.datagen.hack_monitor", "composer_replication.safety.hack_monitor"),
        ("composer_replication.datagen.scrub", "composer_replication.sandbox.scrub"),
        ("composer_replication.distillation.dpo", "composer_replication.ops.dpo"),
        ("composer_replication.distillation.simpo", "composer_replication.ops.simpo"),
        ("composer_replication.distillation.taid", "composer_replication.ops.taid"),
        (
            "composer_replication.distillation.entropy_aware_opd",
            "composer_replication.ops.entropy_aware_opd",
        ),
    ],
)
def test_moved_modules_keep_their_first_paths_as_the_same_objects(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)


ARCHITECTURE_DOC = PACKAGE.parents[1] / "docs" / "architecture.md"


def _package_entries(package: Path) -> set[str]:
    """The package's subpackages (``name/``) and top-level modules (``name.py``)."""
    out = set()
    for path in package.iterdir():
        if path.is_dir() and path.name != "__pycache__" and not path.name.startswith("."):
            out.add(f"{path.name}/")
        elif path.suffix == ".py":
            out.add(path.name)
    return out


def _missing_rows(doc: str, entries: set[str]) -> list[str]:
    """Entries with no table row of their own (a line starting ``| `entry` |``)."""
    rows = set(re.findall(r"^\| `([^`]+)` \|", doc, flags=re.MULTILINE))
    return sorted(entries - rows)


def test_the_architecture_doc_has_a_row_for_every_package_and_module():
    entries = _package_entries(PACKAGE)
    assert {"trainer/", "ops/", "samples/"} <= entries  # the listing sees the package
    missing = _missing_rows(ARCHITECTURE_DOC.read_text(encoding="utf-8"), entries)
    assert missing == [], (
        f"docs/architecture.md has no row for {missing}: add one per entry to its "
        "'every package and module' tables, saying what the entry is for"
    )


def test_the_doc_check_sees_a_missing_row():
    doc = "| `ops/` | the loss core |\n| `wire.py` | samples |\nthe `trainer/` in prose\n"
    assert _missing_rows(doc, {"ops/", "wire.py", "trainer/", "roles.py"}) == [
        "roles.py",
        "trainer/",
    ]
