"""``python -m hybridflow.trainer.main_rm key=value ...``: reward-model training (``hybridflow rm``); see ``main_sft``."""

from __future__ import annotations

from hybridflow.trainer.main_sft import run


def main(argv: list[str] | None = None) -> int:
    return run("rm", argv)


if __name__ == "__main__":
    raise SystemExit(main())
