"""Fixtures of the trainer tests."""

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridflow.data.prepare import main as prepare_data


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Callable[[int, int], Path]:
    """``arithmetic_data(train_size, test_size)``: a folder with the arithmetic task's train.parquet and
    test.parquet, seeded."""

    def make(train_size: int, test_size: int) -> Path:
        out = tmp_path_factory.mktemp("arith")
        prepare_data(
            [
                "arithmetic",
                str(out),
                "--train-size",
                str(train_size),
                "--test-size",
                str(test_size),
                "--seed",
                "0",
            ]
        )
        return out

    return make


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    """The arithmetic task: 64 training and 8 test prompts (parquet), seeded."""
    return arithmetic_data(64, 8)
