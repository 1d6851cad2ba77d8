"""``python -m hybridflow.trainer.main_dpo key=value ...``: the DPO trainer (``hybridflow dpo``); see ``main_sft``."""

from __future__ import annotations

from hybridflow.trainer.main_sft import run


def main(argv: list[str] | None = None) -> int:
    return run("dpo", argv)


if __name__ == "__main__":
    raise SystemExit(main())
