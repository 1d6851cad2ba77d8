"""``python -m hybridflow.trainer.main_ppo key=value ...``: a PPO-family run from the packaged config.

Overrides use Hydra's dotted syntax (``+key=value`` adds a key); ``--config FILE.yaml`` merges a user
config over the defaults first. verl quickstart command lines work with the module name changed.
A mistake in the input (an unknown key, a bad value, a missing file, a malformed data row, a reward function
that returns text...) exits with status 2 and one line naming the culprit; ``--debug`` (or
``HYBRIDFLOW_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

from hybridflow.config.schema import load_config
from hybridflow.runs.tracking import show_info_logs
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.utils.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    return run_cli("hybridflow train", train_command, sys.argv[1:] if argv is None else argv)


def train_command(argv: list[str]) -> int:
    """``hybridflow train``'s body; input errors propagate as ``UserError`` (``run_cli`` prints them)."""
    parser = argparse.ArgumentParser(
        prog="hybridflow train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="a YAML file merged over the packaged ppo_trainer.yaml")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as data.train_batch_size=16")
    args = parser.parse_args(argv)
    config = load_config(args.overrides, config_path=args.config)
    show_info_logs()
    with PPOTrainer(config) as trainer:
        trainer.fit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
