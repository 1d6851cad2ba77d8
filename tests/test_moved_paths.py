"""Public paths that moved keep working for one release, with a DeprecationWarning naming the new path, and
the README lists them (``hybridflow.MOVED_MODULES``; config keys: the schema's ``RENAMED``)."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hybridflow
from hybridflow.config import PPOConfig

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(("old", "new"), sorted(hybridflow.MOVED_MODULES.items()))
def test_a_moved_module_imports_as_the_new_one_with_a_warning_naming_it(old, new, monkeypatch):
    """Before: ``from hybridflow.trainer.config import ...``, as the previous README had it, raised
    ModuleNotFoundError."""
    monkeypatch.delitem(sys.modules, old, raising=False)  # as in a fresh interpreter
    with pytest.warns(
        DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)}; the old path"
    ):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # the new module keeps its own spec (reload, pickling by name)


def test_the_names_of_a_moved_module_are_the_new_ones(monkeypatch):
    monkeypatch.delitem(sys.modules, "hybridflow.trainer.config", raising=False)
    with pytest.warns(
        DeprecationWarning, match="hybridflow.trainer.config moved to hybridflow.config.schema"
    ):
        from hybridflow.trainer.config import DataConfig, load_config
    assert (DataConfig.__module__, load_config(["data.train_files=[a.parquet]"]).data.train_files) == (
        "hybridflow.config.schema",
        ["a.parquet"],
    )


def test_an_old_module_path_runs_with_python_m_and_says_where_it_went():
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: hybridflow COMMAND")
    assert (
        "DeprecationWarning: hybridflow.cli moved to hybridflow.commands.cli" in out.stderr
    )  # shown by default


def test_the_readme_names_every_moved_path_and_key():
    readme = " ".join(README.read_text().split())
    moved = [*hybridflow.MOVED_MODULES, *PPOConfig.RENAMED, *PPOConfig.RENAMED.values()]
    assert [path for path in moved if f"`{path}`" not in readme] == []
