"""The layering rule of the README: a top-level module imports only modules of earlier tiers.

Imports inside functions count too (a lazy import is still a dependency). Modules in one tier sit beside
each other and import none of the others.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

TIERS: list[tuple[str, ...]] = [
    ("utils", "protocol", "models"),
    ("algorithms",),
    ("single_controller", "rewards", "dataflow", "tools"),
    ("data",),  # the offline task data judges the model's own samples with the rule scorers
    ("workers",),
    ("serving",),  # the OpenAI-compatible endpoint over a rollout engine, the served rollout
    ("trainer",),
    ("config", "demo", "cli"),
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


def test_a_wrong_way_import_is_caught(tmp_path):
    for module, text in {
        "protocol.py": "from hybridflow.trainer import PPOTrainer\n",
        "workers/x.py": "def f():\n    import hybridflow.data.dataset\n",
        "trainer/ok.py": "from hybridflow.workers import CriticWorker\nfrom hybridflow import data\n",
        "rewards/y.py": "from hybridflow import dataflow\n",
    }.items():
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(text)
    assert layering_violations(tmp_path) == [
        "protocol.py:1 imports hybridflow.trainer (tier 6) from tier 0 (protocol)",
        "rewards/y.py:1 imports hybridflow.dataflow (tier 2) from tier 2 (rewards)",
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
