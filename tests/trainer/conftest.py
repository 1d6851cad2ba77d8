"""Fixtures of the trainer tests."""

from pathlib import Path

import pytest

from hybridflow.data.prepare import main as prepare_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The arithmetic task: 64 training and 8 test prompts (parquet), seeded."""
    out = tmp_path_factory.mktemp("arith")
    prepare_data(["arithmetic", str(out), "--train-size", "64", "--test-size", "8", "--seed", "0"])
    return out
