"""``python -m hybridflow.trainer.main_sft key=value ...``: supervised fine-tuning (``hybridflow sft``).

The packaged ``sft_trainer.yaml`` (verl's SFT key names), a ``--config FILE.yaml`` merged over it, then
dotted overrides. ``main_dpo``, ``main_kto`` and ``main_rm`` are the same command for the other offline trainers. As for
``main_ppo``, a mistake in the input (a config key, a missing or malformed data file, a model path) exits with
status 2 and one line naming the culprit (``run_cli``); ``--debug`` (or ``HYBRIDFLOW_DEBUG=1``) shows the
traceback.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.config.offline import CONFIGS, default_config_path, load_offline_config
from hybridflow.runs.tracking import show_info_logs
from hybridflow.trainer.offline import OfflineTrainer
from hybridflow.utils.errors import run_cli


def run(kind: str, argv: list[str] | None = None) -> int:
    """``python -m hybridflow.trainer.main_<kind>`` (sft | dpo | kto | rm): ``offline_command`` through ``run_cli``."""
    return run_cli(
        f"hybridflow {kind}", lambda args: offline_command(kind, args), sys.argv[1:] if argv is None else argv
    )


def offline_command(kind: str, argv: list[str]) -> int:
    """``hybridflow <kind>``'s body: parse ``argv`` for the offline trainer ``kind``, train, save; input errors
    propagate as ``UserError`` (``run_cli`` prints them)."""
    cls = CONFIGS[kind]
    parser = argparse.ArgumentParser(prog=f"hybridflow {kind}", description=cls.__doc__)
    parser.add_argument(
        "--config", help=f"a YAML file merged over the packaged {default_config_path(cls).name}"
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides such as data.train_files=train.parquet"
    )
    args = parser.parse_args(argv)
    config = load_offline_config(cls, args.overrides, config_path=args.config)
    show_info_logs()
    with OfflineTrainer(config) as trainer:
        trainer.fit()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("sft", argv)


if __name__ == "__main__":
    raise SystemExit(main())
