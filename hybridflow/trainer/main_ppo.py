"""``python -m hybridflow.trainer.main_ppo key=value ...``: a PPO-family run from the packaged config.

Overrides use Hydra's dotted syntax (``+key=value`` adds a key); ``--config FILE.yaml`` merges a user
config over the defaults first. verl quickstart command lines work with the module name changed.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo import PPOTrainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML file merged over the packaged ppo_trainer.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as data.train_batch_size=16")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    PPOTrainer(load_config(args.overrides, config_path=args.config)).fit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
