"""``python -m hybridflow.trainer.main_kto key=value ...``: the KTO trainer (``hybridflow kto``); see ``main_sft``."""

from __future__ import annotations

from hybridflow.trainer.main_sft import run


def main(argv: list[str] | None = None) -> int:
    return run("kto", argv)


if __name__ == "__main__":
    raise SystemExit(main())
