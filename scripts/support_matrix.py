"""Print the README's model-family table (``hybridflow.workers.support.family_matrix``), or with ``--write``
put it in README.md between its markers; ``tests/models/test_families.py`` fails when the README's is stale.

    .venv/bin/python scripts/support_matrix.py [--write]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.workers.support import README_MARKERS, family_matrix

README = Path(__file__).resolve().parents[1] / "README.md"


def with_matrix(text: str, matrix: str) -> str:
    """``text`` (the README) with the block between the markers replaced by ``matrix``."""
    begin, end = README_MARKERS
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{matrix}\n{end}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    args = parser.parse_args()
    matrix = family_matrix()
    if args.write:
        README.write_text(with_matrix(README.read_text(), matrix))
    print(matrix)


if __name__ == "__main__":
    main()
