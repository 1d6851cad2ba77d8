"""The layering rule of the README: a room (top-level package or module) imports only rooms of earlier
tiers, and no two modules import each other, directly or round a longer cycle.

Imports inside functions count too (a lazy import is still a dependency). Rooms in one tier sit beside
each other and import none of the others.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

TIERS: list[tuple[str, ...]] = [
    ("utils", "protocol", "models"),
    ("algorithms",),
    ("dataflow",),  # generic driver pieces; the config checks ask the replay sampler about its settings
    ("config",),  # the typed sections the workers and trainers read
    ("single_controller", "tools", "runs", "rollout"),  # rollout: the engine contract, its registry
    ("rewards",),  # the code scorer runs programs in the python tool's sandbox
    ("data",),  # the offline task data judges the model's own samples with the rule scorers
    ("serving",),  # the OpenAI-compatible endpoint over any rollout, the served rollout (a rollout mode)
    ("workers",),  # build the served rollout over their engine, as the agent loop
    ("trainer",),
    ("commands",),
]
TIER = {name: i for i, names in enumerate(TIERS) for name in names}


def _top_level(path: Path, package: Path) -> str:
    return path.relative_to(package).parts[0].removesuffix(".py")


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of every ``hybridflow.X`` import in the file."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + (
                [f"{node.module}.{a.name}" for a in node.names] if node.module == "hybridflow" else []
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("hybridflow.")]
    return found


def _imported_modules(tree: ast.AST, modules: set[str] | dict[str, Path]) -> set[str]:
    """The hybridflow modules the file imports: ``from a import b`` is the module ``a.b`` when there is one,
    else ``a`` (``b`` is a name defined in ``a``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name in modules}


def _module_name(path: Path, package: Path) -> str:
    parts = ("hybridflow", *path.relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_cycles(package: Path = PACKAGE) -> list[str]:
    """Every cycle of imports between modules, as ``a -> b -> a``; a package's ``__init__`` is the module
    named by the package."""
    paths = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph = {
        name: sorted(_imported_modules(ast.parse(path.read_text()), paths) - {name})
        for name, path in paths.items()
    }
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the current path, 2 done

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for other in graph[name]:
            if state[other] == 1:
                cycles.append(" -> ".join([*trail[trail.index(other) :], other]))
            elif state[other] == 0:
                visit(other, [*trail, other])
        state[name] = 2

    for name in graph:
        if state[name] == 0:
            visit(name, [name])
    return cycles


def layering_violations(package: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        if path.parent == package and path.name == "__init__.py":
            continue  # the package root re-exports (lazily) from every layer
        own = _top_level(path, package)
        if own not in TIER:
            problems.append(f"{path.relative_to(package)}: top-level module {own!r} is in no tier of TIERS")
            continue
        for line, other in _imported(ast.parse(path.read_text())):
            if other != own and TIER.get(other, len(TIERS)) >= TIER[own]:
                problems.append(
                    f"{path.relative_to(package)}:{line} imports hybridflow.{other} "
                    f"(tier {TIER.get(other)}) from tier {TIER[own]} ({own})"
                )
    return problems


def test_every_import_goes_to_an_earlier_layer():
    assert layering_violations() == []


def test_no_module_imports_itself_round_a_cycle():
    assert module_cycles() == []


def test_a_cycle_is_caught_even_through_a_function(tmp_path):
    files = {
        "__init__.py": "",
        "config/__init__.py": "from hybridflow.config.schema import Config\n",
        "config/schema.py": "def load():\n    from hybridflow.config.loader import read\n",
        "config/loader.py": "from hybridflow.config import schema\n",
        "tools/base.py": "from hybridflow.tools.calculator import Calculator\n",
        "tools/calculator.py": "from hybridflow.tools.base import BaseTool\n",
        "tools/parsing.py": "from hybridflow.tools.base import BaseTool\n",
    }
    for module, text in files.items():
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(text)
    assert module_cycles(tmp_path) == [
        "hybridflow.config.schema -> hybridflow.config.loader -> hybridflow.config.schema",
        "hybridflow.tools.base -> hybridflow.tools.calculator -> hybridflow.tools.base",
    ]


def test_a_wrong_way_import_is_caught(tmp_path):
    for module, text in {
        "protocol.py": "from hybridflow.trainer import PPOTrainer\n",
        "workers/x.py": "def f():\n    import hybridflow.data.dataset\n",
        "trainer/ok.py": "from hybridflow.workers import CriticWorker\nfrom hybridflow import data\n",
        "runs/y.py": "from hybridflow import tools\n",
    }.items():
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(text)
    assert layering_violations(tmp_path) == [
        "protocol.py:1 imports hybridflow.trainer (tier 9) from tier 0 (protocol)",
        "runs/y.py:1 imports hybridflow.tools (tier 4) from tier 4 (runs)",
    ]


def test_the_readme_states_the_same_order():
    readme = (PACKAGE.parent / "README.md").read_text()
    order = " -> ".join(", ".join(f"`{name}`" for name in tier) for tier in TIERS)
    assert order in " ".join(readme.split()), f"the README should state the layering as: {order}"


_OUTSIDE = re.compile(r"(?:\.\./)+[\w./-]+|\b[\w./-]*\w\.md\b")


def test_no_docstring_points_at_a_file_outside_the_repo():
    """Sources mention files a reader can open: no ``../`` paths out of the repository, no missing ``.md``."""
    root = PACKAGE.parent
    found = [
        f"{path.relative_to(root)}:{n}: {match}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for match in _OUTSIDE.findall(line)
        if match.startswith("../") or not ((root / match).exists() or (path.parent / match).exists())
    ]
    assert found == []
    assert _OUTSIDE.findall("see ../shared/FACTS.md and FACTS.md") == ["../shared/FACTS.md", "FACTS.md"]


def test_every_room_says_what_it_holds_and_git_ignores_no_source_file():
    """Before: ``.gitignore``'s ``runs/`` (meant for run folders) also matched ``hybridflow/runs/`` (and
    ``tests/runs/``): a new file there was not committed (the room's ``__init__.py`` never was) and ruff,
    which follows ``.gitignore``, skipped the room."""
    rooms = [p for p in sorted(PACKAGE.iterdir()) if p.is_dir() and any(p.glob("*.py"))]
    assert [p.name for p in rooms if not (p / "__init__.py").is_file()] == []
    assert [p.name for p in rooms if not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))] == []
    root = PACKAGE.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    sources = [
        str(p.relative_to(root)) for p in sorted(root.glob("[ht]*/**/*.py")) if "__pycache__" not in p.parts
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *sources], cwd=root, capture_output=True, text=True
    )
    assert ignored.stdout.split() == []
    probe = subprocess.run(["git", "check-ignore", "runs/demo/metrics.jsonl"], cwd=root, capture_output=True)
    assert probe.returncode == 0  # run folders at the top stay ignored


_SOURCE_FILE = re.compile(r"``([\w./-]+\.py|[\w.-]+/[\w./-]+\.yaml)``")


def test_every_source_file_a_docstring_names_exists():
    """Before: ``config/schema.py`` sent readers to ``config_loader.py``, ``config_checks.py`` and
    ``config/ppo_trainer.yaml``, which had moved. A ``name.py`` (or ``folder/name.yaml``) in double backticks is
    found beside the module, in its room, in the package, or anywhere in the package by its name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in _SOURCE_FILE.findall(line):
                places = [path.parent / name, PACKAGE / _top_level(path, PACKAGE) / name, PACKAGE / name]
                places += (
                    [PACKAGE.parent / name, *PACKAGE.rglob(name)]
                    if "/" not in name
                    else [PACKAGE.parent / name]
                )
                if not any(place.exists() for place in places):
                    found.append(f"{path.relative_to(PACKAGE)}:{n}: {name}")
    assert found == []


def undocumented_functions(room: Path) -> list[str]:
    """``file:line name`` of every public function and method in ``room`` without a docstring."""
    found = []
    for path in sorted(room.rglob("*.py")):
        tree = ast.parse(path.read_text())
        classes = [
            node for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
        ]
        for owner, body in [("", tree.body), *((f"{c.name}.", c.body) for c in classes)]:
            found += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}{node.name}"
                for node in body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and not node.name.startswith("_")
                and not ast.get_docstring(node)
            ]
    return found


def test_every_public_function_of_the_commands_says_what_it_does():
    """Before: 61 % of ``commands/``'s public functions and methods had a docstring (14 of 36 had none)."""
    assert undocumented_functions(PACKAGE / "commands") == []
