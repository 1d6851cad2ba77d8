"""``python -m hybridflow.trainer.main_ppo key=value ...``: a PPO-family run from the packaged config.

Overrides use Hydra's dotted syntax (``+key=value`` adds a key); ``--config FILE.yaml`` merges a user
config over the defaults first. verl quickstart command lines work with the module name changed.
A config mistake (unknown key, bad value) exits with status 2 and one line naming the key, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.ppo import PPOTrainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML file merged over the packaged ppo_trainer.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as data.train_batch_size=16")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.overrides, config_path=args.config)
    except ConfigError as e:
        print(f"hybridflow train: error: {e}", file=sys.stderr)
        return 2
    _show_info_logs()
    with PPOTrainer(config) as trainer:
        trainer.fit()
    return 0


def _show_info_logs() -> None:
    """hybridflow's own INFO messages (e.g. which checkpoint a run resumed from) on stderr, other
    libraries' logging left as it is."""
    log = logging.getLogger("hybridflow")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


if __name__ == "__main__":
    raise SystemExit(main())
