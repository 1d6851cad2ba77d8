"""``python -m hybridflow.trainer.main_sft key=value ...``: supervised fine-tuning (``hybridflow sft``).

The packaged ``sft_trainer.yaml`` (verl's SFT key names), a ``--config FILE.yaml`` merged over it, then
dotted overrides. ``main_dpo``, ``main_kto`` and ``main_rm`` are the same command for the other offline trainers.
A config mistake exits with status 2 and one line naming the key, not a traceback.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.config.offline import CONFIGS, default_config_path, load_offline_config
from hybridflow.config.schema import ConfigError
from hybridflow.trainer.main_ppo import _show_info_logs
from hybridflow.trainer.offline import OfflineTrainer


def run(kind: str, argv: list[str] | None = None) -> int:
    """Parse ``argv`` for the offline trainer ``kind`` (sft | dpo | kto | rm), train, save; exit status."""
    cls = CONFIGS[kind]
    parser = argparse.ArgumentParser(prog=f"hybridflow {kind}", description=cls.__doc__)
    parser.add_argument(
        "--config", help=f"a YAML file merged over the packaged {default_config_path(cls).name}"
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides such as data.train_files=train.parquet"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_offline_config(cls, args.overrides, config_path=args.config)
    except ConfigError as e:
        print(f"hybridflow {kind}: error: {e}", file=sys.stderr)
        return 2
    _show_info_logs()
    with OfflineTrainer(config) as trainer:
        trainer.fit()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("sft", argv)


if __name__ == "__main__":
    raise SystemExit(main())
