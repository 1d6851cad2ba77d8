"""The ``hybridflow`` command: ``train``, ``sft``, ``dpo``, ``kto``, ``rm``, ``config``, ``prepare-data``,
``make-tiny-model``, ``generate``, ``serve``, ``report``, ``doctor``.

Every command prints an input error (``UserError``) as one ``hybridflow <cmd>: error: ...`` line with exit
status 2; ``--debug`` (any command) or ``HYBRIDFLOW_DEBUG=1`` shows its traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from hybridflow.utils.errors import run_cli


def _generate(argv: list[str]) -> int:
    from hybridflow.commands.generate import main

    return main(argv)


def _serve(argv: list[str]) -> int:
    from hybridflow.commands.serve import main

    return main(argv)


def _report(argv: list[str]) -> int:
    from hybridflow.commands.report import main

    return main(argv)


def _doctor(argv: list[str]) -> int:
    from hybridflow.commands.doctor import main

    return main(argv)


def _train(argv: list[str]) -> int:
    from hybridflow.trainer.main_ppo import train_command

    return train_command(argv)


def _config(argv: list[str]) -> int:
    from hybridflow.config.docs import main

    return main(argv)


def _offline(kind: str) -> Callable[[list[str]], int]:
    def command(argv: list[str]) -> int:
        from hybridflow.trainer.main_sft import offline_command

        return offline_command(kind, argv)

    return command


def _prepare_data(argv: list[str]) -> int:
    from hybridflow.data.prepare import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from hybridflow.commands.demo import main

    return main(argv)


def _make_tiny_model(argv: list[str]) -> int:
    from hybridflow.models.tiny import main

    return main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "run PPO/GRPO/... training: hybridflow train key=value ..."),
    "demo": (
        _demo,
        "GRPO on the embedded SmolLM2 and the arithmetic task (make demo): hybridflow demo [key=value ...]",
    ),
    "config": (_config, "inspect the config: hybridflow config show [key=value ...] | keys | yaml [--write]"),
    "sft": (_offline("sft"), "supervised fine-tuning: hybridflow sft data.train_files=... key=value ..."),
    "dpo": (_offline("dpo"), "preference optimisation (DPO/IPO/hinge): hybridflow dpo data.train_files=..."),
    "kto": (_offline("kto"), "KTO on good/bad completions: hybridflow kto data.train_files=..."),
    "rm": (_offline("rm"), "train a reward model on preference pairs: hybridflow rm data.train_files=..."),
    "prepare-data": (
        _prepare_data,
        "write train/test parquet for a task: hybridflow prepare-data TASK OUT_DIR",
    ),
    "make-tiny-model": (_make_tiny_model, "save a tiny random model + tokenizer for tests and examples"),
    "generate": (
        _generate,
        "answer prompts with a checkpoint: hybridflow generate --model PATH [--image FILE] --prompt ...",
    ),
    "serve": (_serve, "an OpenAI-compatible endpoint over a checkpoint: hybridflow serve --model PATH"),
    "report": (
        _report,
        "curves, stage timeline and samples of run(s) as HTML: hybridflow report RUN_DIR [RUN_B]",
    ),
    "doctor": (_doctor, "check a config before launching: hybridflow doctor [--json] key=value ..."),
}


def main(argv: list[str] | None = None) -> int:
    """``hybridflow COMMAND [ARGS]``: the command's exit status (2 for an input error, printed as one line);
    no command, or ``--help``, lists them."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items())
        print(f"usage: hybridflow COMMAND [ARGS]\n\ncommands:\n{lines}")
        known = not argv or argv[0] in ("-h", "--help")
        if not known:
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
        return 0 if known else 2
    return run_cli(f"hybridflow {argv[0]}", COMMANDS[argv[0]][0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
