"""The package layout docs/contributing.md draws: no import circles, arrows pointing down, one draft builder.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The order of docs/contributing.md's layout, from the ground up: a package may import only packages before it.
ORDER = [
    "layerskip.errors",
    "layerskip.fileio",
    "layerskip.data",
    "layerskip.sampling",
    "layerskip.stats",
    "layerskip.machine",
    "layerskip.hf",
    "layerskip.result_cache",
    "layerskip.drafts",
    "layerskip.engine",
    "layerskip.integration",
    "layerskip.measure",
    "layerskip.distill",
    "layerskip.cli",
    "layerskip.search",  # the search/ folder, installed as layerskip.search: nothing in the library imports it
]
# Where each source folder installs (pyproject.toml's package-dir): search/ is layerskip.search.
INSTALLED_AS = {"layerskip": "layerskip", "search": "layerskip.search"}


def _module(path: Path) -> str:
    """The module a source file installs as: ``search/cli.py`` -> ``layerskip.search.cli``."""
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = [INSTALLED_AS[folder], *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("layerskip", "search", "optuna")}


def _sources() -> dict[str, Path]:
    return {_module(p): p for root in INSTALLED_AS for p in (ROOT / root).rglob("*.py")}


def test_arrows_point_down_the_layout() -> None:
    rank = {package: i for i, package in enumerate(ORDER)}
    wrong = []
    for module, path in _sources().items():
        if module == "layerskip":
            continue  # the facade re-exports the public names
        mine = _package(module)
        assert mine in rank, f"{module} is in no package of the layout; add it to ORDER and docs/contributing.md"
        for target in _imports(path):
            theirs = _package(target)
            if theirs == "layerskip" or theirs == mine or target.startswith("optuna"):
                continue
            if rank.get(theirs, -1) > rank[mine]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that run up the layout: " + ", ".join(sorted(wrong))


def test_the_library_never_imports_the_search_or_optuna() -> None:
    """``import layerskip`` (the facade included) needs neither the search nor Optuna; the search
    imports only its own folder as ``layerskip.search`` (a top-level ``search`` is not installed)."""
    wrong = []
    for module, path in _sources().items():
        for target in _imports(path):
            top = target.split(".")[0]
            in_search = module.startswith("layerskip.search")
            if top == "search" or (not in_search and (top == "optuna" or target.startswith("layerskip.search"))):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports the library must not make: " + ", ".join(sorted(wrong))


def test_pyproject_installs_every_package_folder() -> None:
    """pyproject.toml lists its packages by hand (search/ maps into layerskip): a new folder of
    sources must be listed there, or a wheel would leave it out."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"layerskip.search": "search"}
    holding = [
        path.parent for root in INSTALLED_AS for path in (ROOT / root).rglob("*") if path.suffix in (".py", ".jsonl")
    ]
    # A folder that holds only a folder (custom_generate/custom_generate) is a package too.
    folders = {
        folder for path in holding for folder in (path, *path.parents) if folder.is_relative_to(ROOT) and folder != ROOT
    }
    expected = {_module(folder / "__init__.py") for folder in folders if "__pycache__" not in folder.parts}
    assert sorted(setuptools["packages"]) == sorted(expected)


def test_package_inits_import_only_their_own_package() -> None:
    for module, path in _sources().items():
        if path.name != "__init__.py" or module == "layerskip":
            continue
        outside = [t for t in _imports(path) if not t.startswith(module + ".") and t != module]
        assert not outside, f"{module}/__init__.py imports {outside}"


# The engine's face of drafts/ (docs/contributing.md): the drafter interface and the builder.
ENGINE_FACE = ("layerskip.drafts.base", "layerskip.drafts.builder")


def _engine_drafts_imports(source: str) -> list[str]:
    """Each module of drafts/ that ``source`` imports from, lazy imports included, as
    ``line: module`` (``from layerskip.drafts import base`` imports ``layerskip.drafts.base``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
            if node.module == "layerskip.drafts":
                modules = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            f"{node.lineno}: {m}" for m in modules if m == "layerskip.drafts" or m.startswith("layerskip.drafts.")
        ]
    return found


def test_the_engine_uses_drafts_only_through_base_and_the_builder() -> None:
    """``layerskip/engine/`` imports ``drafts.base`` and ``drafts.builder`` and nothing else of
    drafts/: the builder's ``__all__`` is what the engine needs of the rest."""
    assert _engine_drafts_imports("def f():\n    from layerskip.drafts.model.draft_model import DraftModel\n") == [
        "2: layerskip.drafts.model.draft_model"
    ]
    source = "from layerskip.drafts import base, drafters\nimport layerskip.drafts.drafters.auto\n"
    assert _engine_drafts_imports(source) == [
        "1: layerskip.drafts.base",
        "1: layerskip.drafts.drafters",
        "2: layerskip.drafts.drafters.auto",
    ]
    sources = sorted((ROOT / "layerskip" / "engine").rglob("*.py"))
    assert len(sources) > 5
    wrong = [
        f"{path.relative_to(ROOT)}:{found}"
        for path in sources
        for found in _engine_drafts_imports(path.read_text(encoding="utf-8"))
        if found.split(": ")[1] not in ENGINE_FACE
    ]
    assert not wrong, f"the engine reaches past drafts.base and drafts.builder: {wrong}"


# drafts/ from the ground up (drafts/__init__.py): a module imports only its own group and those before it.
DRAFTS_ORDER = ("model", "rules", "base", "policy", "drafters", "builder")


def _drafts_group(module: str) -> str:
    """``layerskip.drafts.model.head`` -> ``model``; ``layerskip.drafts.base`` -> ``base``."""
    return module.split(".")[2]


def test_drafts_shows_its_groups_and_imports_run_down_them() -> None:
    drafts = {m: p for m, p in _sources().items() if m.startswith("layerskip.drafts.")}
    assert len(drafts) > 15
    assert sorted({_drafts_group(m) for m in drafts}) == sorted(DRAFTS_ORDER), "a module of drafts/ outside its groups"
    rank = {group: i for i, group in enumerate(DRAFTS_ORDER)}
    wrong = [
        f"{module} -> {target}"
        for module, path in drafts.items()
        for target in _imports(path)
        if target.startswith("layerskip.drafts.") and rank[_drafts_group(target)] > rank[_drafts_group(module)]
    ]
    assert not wrong, "imports that run up drafts/' groups: " + ", ".join(sorted(wrong))


def _draft_model_calls(source: str) -> list[int]:
    """Lines of ``source`` that call ``DraftModel``, by its name, an alias it was imported as, or as
    an attribute (``model.DraftModel(...)``)."""
    tree = ast.parse(source)
    names = {"DraftModel"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname for a in node.names if a.asname and a.name.split(".")[-1] == "DraftModel")
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in names
    ]


def test_only_the_builder_constructs_a_draft_model() -> None:
    """One owner of draft forwards: the library, the search and the scripts get theirs from
    ``layerskip.drafts.builder`` (``DraftModels``, ``PreparedDraft``), never by constructing one."""
    assert _draft_model_calls("from layerskip.drafts.model.draft_model import DraftModel as D\nD(m)\n") == [2]
    assert _draft_model_calls("from layerskip.drafts.model import draft_model\ndraft_model.DraftModel(m)\n") == [2]
    sources = [path for root in (*INSTALLED_AS, "scripts") for path in sorted((ROOT / root).rglob("*.py"))]
    assert any(path.parent.name == "scripts" for path in sources)
    builders = {}
    for path in sources:
        lines = _draft_model_calls(path.read_text(encoding="utf-8"))
        if lines:
            builders[str(path.relative_to(ROOT))] = lines
    assert sorted(builders) == ["layerskip/drafts/builder.py"], f"DraftModel built outside the builder: {builders}"


MAX_PUBLIC_NAMES = 14  # what a user calls; the engine's parts import from their own modules


def test_public_names_import_from_the_top() -> None:
    import layerskip

    assert len(layerskip.__all__) <= MAX_PUBLIC_NAMES, layerskip.__all__
    assert len(set(layerskip.__all__)) == len(layerskip.__all__)
    for name in layerskip.__all__:  # each resolves, whether imported on first use or not
        assert getattr(layerskip, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from layerskip import *", namespace)
    assert set(layerskip.__all__) <= set(namespace)
    assert set(layerskip.__all__) <= set(dir(layerskip))
    assert Path(layerskip.custom_generate_path(), "custom_generate", "generate.py").is_file()
    from layerskip import fileio  # a submodule still imports by name beside the lazy public names

    assert fileio.__name__ == "layerskip.fileio"


def test_importing_the_package_imports_no_torch() -> None:
    """The public names import on first use: ``import layerskip`` (and a tool that needs only part
    of it) does not pay for torch and transformers up front."""
    import subprocess
    import sys

    check = "import sys, layerskip; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


MAX_FUNCTION_LINES = 80  # a longer function is several steps that want names of their own


def test_no_function_of_the_search_or_the_engine_runs_past_80_lines() -> None:
    """The search reads as its phases (search/phases.py) and the decode loop as its step: no
    function in ``search/`` or ``layerskip/engine/`` runs past 80 lines, docstring included."""
    sources = [*sorted((ROOT / "search").rglob("*.py")), *sorted((ROOT / "layerskip" / "engine").rglob("*.py"))]
    assert len(sources) > 10
    long = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
